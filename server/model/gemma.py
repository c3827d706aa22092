"""Gemma 2 and Gemma 3 text models (Gemma2ForCausalLM, Gemma3ForCausalLM) on the Llama classes.

What differs from Llama: the embedding is scaled by sqrt(hidden_size); RMSNorm multiplies by (1 + w),
so the checkpoint's w is loaded as 1 + w and every norm, fused kernels included, stays a plain RMSNorm;
each layer normalizes the attention and MLP outputs too (post-attention and pre/post-feedforward norms);
the MLP is GELU-tanh gated; the softmax scale is query_pre_attn_scalar**-0.5. The attention options
(sliding window on local layers, Gemma 2's score soft-cap), the final logit soft-cap, Gemma 3's q/k norms
and its local layers' rope theta are ModelConfig fields the Llama classes already honour.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from iterserve.kernels.layer_ops import AttentionFn, LayerOps
from iterserve.server.model.llama import DecoderLayer, LlamaForCausalLM, RMSNorm
from iterserve.server.model.model_config import ModelConfig
from iterserve.server.model.rope import RotaryEmbedding


class GemmaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        # plain torch: no fused kernel for the GELU-tanh gate (yet); two elementwise ops a layer
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, layer: int, rope: RotaryEmbedding, attention_fn: AttentionFn,
                 layer_ops: type[LayerOps]):
        super().__init__(cfg, layer, rope, attention_fn, layer_ops)
        self.mlp = GemmaMLP(cfg)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, positions, kv_cache, meta):
        """As the Llama layer: x is the previous layer's (normalized) output, residual the stream before it."""
        h, residual = self.layer_ops.add_rms_norm(self.input_layernorm, x, residual)
        x = self.post_attention_layernorm(self.self_attn(h, positions, kv_cache, meta))
        h, residual = self.layer_ops.add_rms_norm(self.pre_feedforward_layernorm, x, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class GemmaForCausalLM(LlamaForCausalLM):
    """Serves Gemma2ForCausalLM and Gemma3ForCausalLM (text-only) checkpoints."""

    decoder_layer = GemmaDecoderLayer

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # as HF: the scale rounded to the run's dtype first, then one multiply
        return x * torch.tensor(self.config.hidden_size**0.5, device=x.device).to(x.dtype)

    def checkpoint_value(self, name: str, value: torch.Tensor) -> torch.Tensor:
        # 1 + w in fp32, as HF computes it, before any rounding to the run's dtype
        return value + 1.0 if name.endswith("norm.weight") else value

    @classmethod
    def checkpoint_shapes(cls, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        shapes = super().checkpoint_shapes(config)
        for i in range(config.num_hidden_layers):
            for norm in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
                shapes[f"model.layers.{i}.{norm}.weight"] = (config.hidden_size,)
        return shapes
