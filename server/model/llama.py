"""The Llama family in torch (Llama, Mistral, Qwen2): GQA, RoPE, RMSNorm, SwiGLU, tied or untied head.

It runs on a flattened batch: `input_ids` and `positions` are [num_tokens] across all requests of the
step, and attention goes through the paged KV cache (see kernels/attention_metadata.py). q/k/v and
gate/up are fused into one matmul each, which matters on CPU where every op has a fixed cost.

The attention function and the layer's elementwise ops (`layer_ops`: residual add + RMSNorm, rotary,
SwiGLU) are passed in (kernels/layer_ops.py: `AttentionFn`, `LayerOps`): the C++ ops on CPU, the fused
Triton kernels on CUDA (kernels/triton_backend.py), `TorchLayerOps` by default. Layers hand the
residual stream on separately, as vLLM does, so the residual add can be fused into the next norm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from iterserve.kernels.attention_metadata import AttentionMetadata
from iterserve.kernels.layer_ops import AttentionFn, LayerOps, TorchLayerOps
from iterserve.server.model.cpu_linear import PackedLinear
from iterserve.server.model.model_config import ModelConfig
from iterserve.server.model.rope import RotaryEmbedding


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            # one fused op instead of seven; the same arithmetic as below in fp32 (bit-identical)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Computed in fp32 whatever the run dtype, as HF does, so bf16 runs match it.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding, attention_fn: AttentionFn, layer_ops: type[LayerOps]):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.rope = rope
        self.attention_fn = attention_fn
        self.layer_ops = layer_ops
        self.scale = self.head_dim**-0.5

    def forward(self, x, positions, kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata):
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        # q and k heads are rotated together: half the small ops of rotating each
        qk = qkv[:, : self.q_size + self.kv_size].view(n, self.num_heads + self.num_kv_heads, self.head_dim)
        q, k = self.layer_ops.rotary(self.rope, positions, qk).split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size :].view(n, self.num_kv_heads, self.head_dim)
        o = self.attention_fn(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(o.view(n, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_ops):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.layer_ops = layer_ops

    def forward(self, x):
        return self.down_proj(self.layer_ops.silu_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding, attention_fn: AttentionFn, layer_ops: type[LayerOps]):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, rope, attention_fn, layer_ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, layer_ops)
        self.layer_ops = layer_ops

    def forward(self, x, residual, positions, kv_cache, meta):
        """x: the previous layer's output; residual: the stream before it (None at the first layer)."""
        h, residual = self.layer_ops.add_rms_norm(self.input_layernorm, x, residual)
        x = self.self_attn(h, positions, kv_cache, meta)
        h, residual = self.layer_ops.add_rms_norm(self.post_attention_layernorm, x, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    """Serves LlamaForCausalLM, MistralForCausalLM and Qwen2ForCausalLM checkpoints alike."""

    def __init__(self, cfg: ModelConfig, attention_fn: AttentionFn, max_positions: int,
                 layer_ops: type[LayerOps] = TorchLayerOps):
        super().__init__()
        self.config = cfg
        self.layer_ops = layer_ops
        self.rope = RotaryEmbedding(cfg, max_positions)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, self.rope, attention_fn, layer_ops) for _ in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # Tied checkpoints reuse the embedding matrix; it is not registered twice, so moving the
        # module between devices and dtypes cannot untie it.
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # set by pack_linears(), on the CPU only (see cpu_linear.py), once the model will not move any more
        self.packed_lm_head: PackedLinear | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, positions, kv_cache, meta)
        return self.layer_ops.add_rms_norm(self.norm, x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.packed_lm_head is not None:
            return self.packed_lm_head(hidden).float()
        return F.linear(hidden, self._lm_head_weight()).float()

    def _lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @torch.no_grad()
    def pack_linears(self) -> None:
        """Run the LM head and every projection through oneDNN packed weights (CPU fp32, and bf16 where
        the CPU has it natively; see server/model/cpu_linear.py). Call after the weights are loaded: the packed copies are made now.
        The LM head may share the embedding's weight, so only the projections give their unpacked
        copies back."""
        self.packed_lm_head = PackedLinear(self._lm_head_weight())
        for layer in self.layers:
            for owner, name in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"),
                                (layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj")):
                linear = getattr(owner, name)
                setattr(owner, name, PackedLinear(linear.weight, linear.bias, release_unpacked=True))

    @torch.no_grad()
    def init_dummy_weights(self, seed: int = 0) -> None:
        """Random weights made in place, in the parameters' own dtype and device (vLLM's "dummy" load
        format: benchmarks of a model's shape without its checkpoint)."""
        gen = torch.Generator(device=self.embed_tokens.weight.device).manual_seed(seed)
        for name, param in self.named_parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.02, generator=gen)
            elif name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.zero_()  # biases

    @torch.no_grad()
    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up. Every parameter must be covered."""
        def take(name: str) -> torch.Tensor:
            if name not in weights:
                raise ValueError(f"model: checkpoint is missing tensor {name!r}")
            return weights[name]

        def put(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
            if param.shape != value.shape:
                raise ValueError(f"model: tensor {name!r} has shape {tuple(value.shape)}, expected {tuple(param.shape)}")
            param.copy_(value)

        put(self.embed_tokens.weight, take("model.embed_tokens.weight"), "model.embed_tokens.weight")
        put(self.norm.weight, take("model.norm.weight"), "model.norm.weight")
        if not self.config.tie_word_embeddings:
            put(self.lm_head.weight, take("lm_head.weight"), "lm_head.weight")
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            attn = layer.self_attn
            qkv = [take(f"{p}self_attn.{x}_proj.weight") for x in "qkv"]
            put(attn.qkv_proj.weight, torch.cat(qkv), f"{p}self_attn.qkv_proj.weight")
            if attn.qkv_proj.bias is not None:
                bias = [take(f"{p}self_attn.{x}_proj.bias") for x in "qkv"]
                put(attn.qkv_proj.bias, torch.cat(bias), f"{p}self_attn.qkv_proj.bias")
            put(attn.o_proj.weight, take(f"{p}self_attn.o_proj.weight"), f"{p}self_attn.o_proj.weight")
            if attn.o_proj.bias is not None:
                put(attn.o_proj.bias, take(f"{p}self_attn.o_proj.bias"), f"{p}self_attn.o_proj.bias")
            gate_up = [take(f"{p}mlp.gate_proj.weight"), take(f"{p}mlp.up_proj.weight")]
            put(layer.mlp.gate_up_proj.weight, torch.cat(gate_up), f"{p}mlp.gate_up_proj.weight")
            put(layer.mlp.down_proj.weight, take(f"{p}mlp.down_proj.weight"), f"{p}mlp.down_proj.weight")
            put(layer.input_layernorm.weight, take(f"{p}input_layernorm.weight"), f"{p}input_layernorm.weight")
            put(layer.post_attention_layernorm.weight, take(f"{p}post_attention_layernorm.weight"),
                f"{p}post_attention_layernorm.weight")
