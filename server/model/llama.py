"""The Llama family in torch (Llama, Mistral, Qwen2, Qwen3): GQA, RoPE, RMSNorm, SwiGLU, tied or untied
head, optional q/k norms (Qwen3). Phi-3 (phi3.py) and Gemma (gemma.py) build on these classes.

It runs on a flattened batch: `input_ids` and `positions` are [num_tokens] across all requests of the
step, and attention goes through the paged KV cache (see kernels/attention_metadata.py). q/k/v and
gate/up are fused into one matmul each, which matters on CPU where every op has a fixed cost.

The attention function and the layer's elementwise ops (`layer_ops`: residual add + RMSNorm, rotary,
SwiGLU) are passed in (kernels/layer_ops.py: `AttentionFn`, `LayerOps`): the C++ ops on CPU, the fused
Triton kernels on CUDA (kernels/triton_backend.py), `TorchLayerOps` by default. Layers hand the
residual stream on separately, as vLLM does, so the residual add can be fused into the next norm.

On the CPU, where every piece of a layer is a C++ kernel (bf16 projections in the AVX512-BF16 kernel),
decode-only steps run the whole stack in one call instead (kernels/cpu_decode_stack.py): the same
kernels in the same order, without the Python between them.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from iterserve.kernels import cpu_decode_stack
from iterserve.kernels.attention_metadata import AttentionMetadata
from iterserve.kernels.cpu_decode_stack import DecodeStack, StackLayer
from iterserve.kernels.cpu_layer_ops import CpuLayerOps
from iterserve.kernels.layer_ops import AttentionFn, LayerOps, TorchLayerOps
from iterserve.kernels.paged_attention_torch import paged_attention
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
    def __init__(self, cfg: ModelConfig, layer: int, rope: RotaryEmbedding, attention_fn: AttentionFn,
                 layer_ops: type[LayerOps]):
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
        # Qwen3/Gemma 3: each q and k head is RMS-normalized before RoPE
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = (cfg.query_pre_attn_scalar or self.head_dim) ** -0.5
        # Passed only by the layers that need them, so every other layer keeps the kernels' fast path.
        self.attention_options: dict[str, float] = {}
        window = cfg.layer_window(layer)
        if window:
            self.attention_options["sliding_window"] = window
        if cfg.attn_logit_softcapping:
            self.attention_options["softcap"] = cfg.attn_logit_softcapping

    def forward(self, x, positions, kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata):
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        qk_size = self.q_size + self.kv_size
        if self.q_norm is None or self.k_norm is None:  # both or neither (cfg.qk_norm)
            # q and k heads are rotated together: half the small ops of rotating each
            qk = qkv[:, :qk_size].view(n, self.num_heads + self.num_kv_heads, self.head_dim)
        else:
            q = self.q_norm(qkv[:, : self.q_size].view(n, self.num_heads, self.head_dim))
            k = self.k_norm(qkv[:, self.q_size : qk_size].view(n, self.num_kv_heads, self.head_dim))
            qk = torch.cat((q, k), dim=1)
        q, k = self.layer_ops.rotary(self.rope, positions, qk).split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, qk_size:].view(n, self.num_kv_heads, self.head_dim)
        o = self.attention_fn(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, **self.attention_options)
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
    def __init__(self, cfg: ModelConfig, layer: int, rope: RotaryEmbedding, attention_fn: AttentionFn,
                 layer_ops: type[LayerOps]):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer, rope, attention_fn, layer_ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module = MLP(cfg, layer_ops)  # Gemma's layers put their own MLP here
        self.layer_ops = layer_ops

    def forward(self, x, residual, positions, kv_cache, meta):
        """x: the previous layer's output; residual: the stream before it (None at the first layer)."""
        h, residual = self.layer_ops.add_rms_norm(self.input_layernorm, x, residual)
        x = self.self_attn(h, positions, kv_cache, meta)
        h, residual = self.layer_ops.add_rms_norm(self.post_attention_layernorm, x, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    """Serves LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM checkpoints alike."""

    decoder_layer = DecoderLayer

    def __init__(self, cfg: ModelConfig, attention_fn: AttentionFn, max_positions: int,
                 layer_ops: type[LayerOps] = TorchLayerOps):
        super().__init__()
        self.config = cfg
        self.layer_ops = layer_ops
        self.rope = RotaryEmbedding(cfg, max_positions)
        # Gemma 3's sliding-window layers rotate with their own theta
        self.local_rope = RotaryEmbedding(cfg, max_positions, local=True) if cfg.local_rope_theta else None
        # a server builds on the meta device, then loads: there an explicit weight skips the random init,
        # whose normal_ on meta imports torch._dynamo (~2 s of start-up); a model built for real is drawn
        embedding = torch.empty(cfg.vocab_size, cfg.hidden_size)
        if not embedding.is_meta:
            nn.init.normal_(embedding)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=embedding)
        self.layers = nn.ModuleList(
            self.decoder_layer(cfg, i, self.layer_rope(i), attention_fn, layer_ops)
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # Tied checkpoints reuse the embedding matrix; it is not registered twice, so moving the
        # module between devices and dtypes cannot untie it.
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # set by pack_linears(), on the CPU only (see cpu_linear.py), once the model will not move any more
        self.packed_lm_head: PackedLinear | None = None
        self.decode_stack: DecodeStack | None = None  # set by pack_linears() where it serves

    def layer_rope(self, layer: int) -> RotaryEmbedding:
        if self.local_rope is not None and self.config.layer_window(layer):
            return self.local_rope
        return self.rope

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        x, residual = self.embed(input_ids), None
        if self.decode_stack is not None and meta.decode_only and self.decode_stack.serves(x, kv_caches[0][0]):
            g = meta.single_groups[0]
            return self.decode_stack.forward(x, positions, meta.slot_mapping, g.context_blocks, g.context_lens,
                                             meta.block_size, kv_caches)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, positions, kv_cache, meta)
        return self.layer_ops.add_rms_norm(self.norm, x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """The logits of `hidden`'s rows, in float32 (`upcast`, what sampling and logprobs read) or in the
        model's dtype (an argmax of bf16 logits equals the argmax of their exact float32 copies)."""
        if self.packed_lm_head is not None:
            logits = self.packed_lm_head(hidden)
        else:
            logits = F.linear(hidden, self._lm_head_weight())
        if upcast:
            logits = logits.float()
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap  # Gemma 2

    def _lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @torch.no_grad()
    def pack_linears(self) -> None:
        """Run the LM head and every projection through oneDNN packed weights (CPU fp32, and bf16 where
        the CPU has it natively; see server/model/cpu_linear.py). Call after the weights are loaded: the packed copies
        are made now.
        The LM head may share the embedding's weight, so only the projections give their unpacked
        copies back."""
        self.packed_lm_head = PackedLinear(self._lm_head_weight())
        for layer in self.layers:
            for owner, name in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"),
                                (layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj")):
                linear = getattr(owner, name)
                setattr(owner, name, PackedLinear(linear.weight, linear.bias, release_unpacked=True))
        self.decode_stack = self._decode_stack()

    def _decode_stack(self) -> DecodeStack | None:
        """The C++ decode stack over these layers, where each piece of every layer is one of its kernels:
        a plain Llama layer (no q/k norms, window or soft-cap) whose projections the bf16 kernel packed."""
        if type(self).decoder_layer is not DecoderLayer or self.layer_ops is not CpuLayerOps \
                or not cpu_decode_stack.available():
            return None
        layers, attentions = [], []
        for layer in self.layers:
            if not isinstance(layer, DecoderLayer) or not isinstance(layer.mlp, MLP):
                return None
            attn, mlp = layer.self_attn, layer.mlp
            kernel = [p for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
                      if isinstance(p, PackedLinear) and p.in_kernel]
            if (len(kernel) < 4 or attn.q_norm is not None or attn.attention_options
                    or attn.attention_fn is not paged_attention or attn.rope.cos_cache.dtype != torch.float32):
                return None
            qkv, o, gate_up, down = cast("list[PackedLinear]", kernel)
            layers.append(StackLayer(
                input_norm=layer.input_layernorm.weight.detach(),
                post_norm=layer.post_attention_layernorm.weight.detach(),
                qkv=qkv.packed, qkv_bias=qkv.kernel_bias, o=o.packed, o_bias=o.kernel_bias,
                gate_up=gate_up.packed, down=down.packed, cos=attn.rope.cos_cache, sin=attn.rope.sin_cache))
            attentions.append(attn)
        first = attentions[0]
        return DecodeStack(layers, self.norm.weight.detach(), self.config.rms_norm_eps, first.num_heads,
                           first.num_kv_heads, first.head_dim, self.config.hidden_size, self.config.intermediate_size,
                           first.scale)

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

    def checkpoint_names(self, name: str) -> list[str]:
        """The checkpoint tensors parameter `name` is made of, concatenated in order: HF names q/k/v and
        gate/up apart, which are fused here into one matmul each."""
        if name == "lm_head.weight":
            return [name]
        for fused, parts in (("self_attn.qkv_proj.", ("q_proj.", "k_proj.", "v_proj.")),
                             ("mlp.gate_up_proj.", ("gate_proj.", "up_proj."))):
            if fused in name:
                return [f"model.{name}".replace(fused, fused.split(".")[0] + "." + part) for part in parts]
        return [f"model.{name}"]

    def checkpoint_value(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """What parameter `name` holds given its checkpoint value (Gemma stores its norms as w - 1)."""
        return value

    @torch.no_grad()
    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy HF-named tensors in (see checkpoint_names). Every parameter must be covered."""
        for name, param in self.named_parameters():
            sources = self.checkpoint_names(name)
            missing = [s for s in sources if s not in weights]
            if missing:
                raise ValueError(f"model: checkpoint is missing tensor {missing[0]!r}")
            value = self.checkpoint_value(name, torch.cat([weights[s] for s in sources]))
            if param.shape != value.shape:
                raise ValueError(f"model: tensor {name!r} has shape {tuple(value.shape)}, "
                                 f"expected {tuple(param.shape)}")
            param.copy_(value)

    @classmethod
    def checkpoint_shapes(cls, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Every tensor the checkpoint must hold, with its HF shape ([out_features, in_features] for linears)."""
        h, hd, inter = config.hidden_size, config.head_dim, config.intermediate_size
        q_out, kv_out = config.num_attention_heads * hd, config.num_key_value_heads * hd
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h),
                                              "model.norm.weight": (h,)}
        if not config.tie_word_embeddings:
            shapes["lm_head.weight"] = (config.vocab_size, h)
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            shapes.update({
                p + "self_attn.q_proj.weight": (q_out, h),
                p + "self_attn.k_proj.weight": (kv_out, h),
                p + "self_attn.v_proj.weight": (kv_out, h),
                p + "self_attn.o_proj.weight": (h, q_out),
                p + "mlp.gate_proj.weight": (inter, h),
                p + "mlp.up_proj.weight": (inter, h),
                p + "mlp.down_proj.weight": (h, inter),
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
            })
            if config.attention_bias:
                shapes.update({
                    p + "self_attn.q_proj.bias": (q_out,),
                    p + "self_attn.k_proj.bias": (kv_out,),
                    p + "self_attn.v_proj.bias": (kv_out,),
                })
            if config.o_proj_bias:
                shapes[p + "self_attn.o_proj.bias"] = (h,)
            if config.qk_norm:
                shapes.update({p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
        return shapes
