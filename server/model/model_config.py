"""The architecture description the engine needs, read from a Hugging Face `config.json` dict.

Decoder-only families: Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2 and Gemma 3 (text). Everything they
differ in (GQA, head_dim, biases, q/k norms, rope scaling, tied embeddings, sliding windows, soft-capping)
is an explicit field, so the model code never has to look at the raw HF dict.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "Phi3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM")
GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
# server/model/rope.py computes each; "longrope" (Phi-3; "su" in older configs) with its short factors only
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")

# Older checkpoints name only `model_type`, not `architectures`.
_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}

_MISSING = object()


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_ids: list[int]
    # Without layer_types, a sliding window is not applied in attention: the engine caps the context at it
    # (Mistral, Qwen2, Phi-3). With layer_types, layers marked "sliding_attention" attend within it.
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over each q and k head before RoPE
    # Gemma: softmax scale query_pre_attn_scalar**-0.5 (not head_dim's), tanh soft-caps on the attention
    # scores and the final logits, and the local (sliding) layers' own rope theta (Gemma 3)
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    local_rope_theta: float | None = None

    @property
    def context_len(self) -> int:
        """The longest context served: max_position_embeddings, capped by a sliding window that attention
        does not apply (no layer_types) and by LongRoPE's original length (its long factors, which HF
        switches to beyond it, are not implemented)."""
        limit = self.max_position_embeddings
        if self.sliding_window and self.layer_types is None:
            limit = min(limit, self.sliding_window)
        if self.rope_scaling and self.rope_scaling.get("rope_type") == "longrope":
            limit = min(limit, self.rope_scaling["original_max_position_embeddings"])
        return limit

    @property
    def needs_masked_attention(self) -> bool:
        """Whether some layer needs in-attention sliding windows or soft-capping (the Triton and C++
        decode kernels implement neither; those layers take the torch path)."""
        return bool(self.attn_logit_softcapping) or (
            self.layer_types is not None and "sliding_attention" in self.layer_types)

    def layer_window(self, layer: int) -> int | None:
        """The sliding window layer `layer` attends within, or None for full attention."""
        if self.layer_types is None or self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    @property
    def o_proj_bias(self) -> bool:
        """Llama's `attention_bias` also puts a bias on o_proj; Qwen2's q/k/v biases do not."""
        return self.attention_bias and self.architecture != "Qwen2ForCausalLM"

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture: {self.architecture!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_key_value_heads: {self.num_key_value_heads} does not divide "
                f"num_attention_heads {self.num_attention_heads}"
            )
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name}: must be a positive number, got {value!r}")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window <= 0):
            raise ValueError(f"sliding_window: must be a positive integer or null, got {self.sliding_window!r}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers or not set(self.layer_types) <= {
                    "sliding_attention", "full_attention"}:
                raise ValueError(f"layer_types: expected {self.num_hidden_layers} of sliding_attention/full_attention, "
                                 f"got {list(self.layer_types)!r}")
            if "sliding_attention" in self.layer_types and not self.sliding_window:
                raise ValueError("sliding_window: layer_types has sliding_attention layers but no window")
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping", "local_rope_theta"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
                raise ValueError(f"{name}: must be a positive number or null, got {value!r}")
        if not all(isinstance(t, int) and t >= 0 for t in self.eos_token_ids):
            raise ValueError(f"eos_token_id: must be token ids, got {self.eos_token_ids!r}")

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], generation_config: dict[str, Any] | None = None) -> ModelConfig:
        """Build from a parsed `config.json`; `generation_config` (parsed `generation_config.json`) may add
        stop tokens, which is where instruct models often list their end-of-turn token."""
        if not isinstance(d, dict):
            raise ValueError(f"config: expected a JSON object, got {type(d).__name__}")
        architecture = _architecture(d)
        if d.get("mlp_bias"):
            raise ValueError("mlp_bias: MLP biases are not supported")
        _check_activation(d, architecture)
        if d.get("partial_rotary_factor", (d.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError("partial_rotary_factor: rotary embedding on part of each head is not supported")

        hidden_size = _get(d, "hidden_size")
        num_heads = _get(d, "num_attention_heads")
        if not isinstance(hidden_size, int) or not isinstance(num_heads, int) or num_heads <= 0:
            raise ValueError(f"hidden_size/num_attention_heads: must be integers, got {hidden_size!r}/{num_heads!r}")
        head_dim = d.get("head_dim") or hidden_size // num_heads
        rope_theta, rope_scaling, local_rope_theta = _rope(d, architecture)
        eos = _token_ids(d.get("eos_token_id"), "eos_token_id")
        if generation_config:
            eos += [t for t in _token_ids(generation_config.get("eos_token_id"), "eos_token_id") if t not in eos]

        return cls(
            architecture=architecture,
            vocab_size=_get(d, "vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=_get(d, "intermediate_size"),
            num_hidden_layers=_get(d, "num_hidden_layers"),
            num_attention_heads=num_heads,
            num_key_value_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=_get(d, "rms_norm_eps"),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=_get(d, "max_position_embeddings"),
            # Gemma's HF config classes default to tied, the others' to untied.
            tie_word_embeddings=bool(d.get("tie_word_embeddings", architecture in GEMMA_ARCHITECTURES)),
            # Qwen2 always has q/k/v biases; its config has no flag for them.
            attention_bias=architecture == "Qwen2ForCausalLM" or bool(d.get("attention_bias", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos,
            sliding_window=_sliding_window(d, architecture),
            layer_types=_gemma_layer_types(d, architecture),
            qk_norm=architecture in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"),
            query_pre_attn_scalar=d.get("query_pre_attn_scalar", 256) if architecture in GEMMA_ARCHITECTURES else None,
            attn_logit_softcapping=_gemma_field(d, architecture, "attn_logit_softcapping", 50.0),
            final_logit_softcapping=_gemma_field(d, architecture, "final_logit_softcapping", 30.0),
            local_rope_theta=local_rope_theta,
        )


def _get(d: dict[str, Any], name: str) -> Any:
    value = d.get(name, _MISSING)
    if value is _MISSING or value is None:
        raise ValueError(f"{name}: missing from the model config")
    return value


def _architecture(d: dict[str, Any]) -> str:
    archs = d.get("architectures") or []
    if not archs and d.get("model_type") in _MODEL_TYPE_TO_ARCH:
        archs = [_MODEL_TYPE_TO_ARCH[d["model_type"]]]
    if not archs:
        raise ValueError("architectures: missing from the model config; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    if archs[0] not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"architectures: {archs[0]!r} is not supported; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return archs[0]


def _rope(d: dict[str, Any], architecture: str) -> tuple[float, dict[str, Any] | None, float | None]:
    """(rope_theta, rope_scaling, the local layers' theta). transformers 5 writes `rope_parameters`
    ({rope_theta, rope_type, ...}; for Gemma 3 one such dict per layer type); older configs write
    `rope_theta` plus `rope_scaling` (whose key was once `type`, not `rope_type`), and Gemma 3's
    `rope_local_base_freq`."""
    params = dict(d.get("rope_parameters") or {})
    local_theta: float | None = None
    if architecture == "Gemma3ForCausalLM":
        local = params.pop("sliding_attention", None) or {}
        params = dict(params.pop("full_attention", None) or params)
        local_theta = local.get("rope_theta", d.get("rope_local_base_freq", 10000.0))
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"rope_parameters.sliding_attention: rope_type {local['rope_type']!r} is not supported")
        params.setdefault("rope_theta", 1_000_000.0)  # Gemma3TextConfig's default global theta
    scaling = d.get("rope_scaling") or {k: v for k, v in params.items() if k != "rope_theta"}
    rope_theta = cast(float, d.get("rope_theta", params.get("rope_theta", 10000.0)))
    if not isinstance(scaling, dict):
        raise ValueError(f"rope_scaling: expected an object or null, got {scaling!r}")
    scaling = dict(scaling)
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    scaling.pop("partial_rotary_factor", None)  # checked (== 1) by the caller
    if scaling.get("rope_type") == "su":  # LongRoPE's first name
        scaling["rope_type"] = "longrope"
    if scaling.get("rope_type", "default") == "default":
        return rope_theta, None, local_theta
    if scaling["rope_type"] not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_scaling: rope_type {scaling['rope_type']!r} is not supported "
                         f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    if scaling["rope_type"] == "longrope":
        scaling.setdefault("original_max_position_embeddings", d.get("original_max_position_embeddings"))
        if not isinstance(scaling["original_max_position_embeddings"], int) or "short_factor" not in scaling:
            raise ValueError("rope_scaling: longrope needs short_factor and original_max_position_embeddings")
    if scaling["rope_type"] == "linear" and "factor" not in scaling:
        raise ValueError("rope_scaling: linear rope scaling needs a factor")
    return rope_theta, scaling, local_theta


def _token_ids(value: Any, name: str) -> list[int]:
    if value is None:
        return []
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ValueError(f"{name}: expected an integer or a list of integers, got {value!r}")
    return list(ids)


def _sliding_window(d: dict[str, Any], architecture: str) -> int | None:
    if architecture == "LlamaForCausalLM":
        return None
    window = d.get("sliding_window")
    if architecture not in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") or window is None:
        return window
    # Qwen2/Qwen3 (as transformers does): the window applies only with use_sliding_window, and then only to
    # layers >= max_window_layers unless layer_types says otherwise.
    if not d.get("use_sliding_window", False):
        return None
    layers = d.get("layer_types") or [
        "sliding_attention" if i >= d.get("max_window_layers", 28) else "full_attention"
        for i in range(_get(d, "num_hidden_layers"))
    ]
    if all(t == "sliding_attention" for t in layers):
        return window
    if all(t == "full_attention" for t in layers):
        return None
    raise ValueError("sliding_window: a sliding window on only some layers (max_window_layers/layer_types) "
                     "is not supported")


def _gemma_layer_types(d: dict[str, Any], architecture: str) -> tuple[str, ...] | None:
    """Which Gemma layers are local (sliding window) and which global: `layer_types`, or the pattern the
    HF config classes default to (Gemma 2 alternates from a local first layer; Gemma 3 has five local
    layers, then a global one)."""
    if architecture not in GEMMA_ARCHITECTURES:
        return None
    if d.get("layer_types"):
        return tuple(d["layer_types"])
    pattern = 2 if architecture == "Gemma2ForCausalLM" else d.get("sliding_window_pattern", 6)
    return tuple("sliding_attention" if (i + 1) % pattern else "full_attention"
                 for i in range(_get(d, "num_hidden_layers")))


def _gemma_field(d: dict[str, Any], architecture: str, name: str, gemma2_default: float) -> float | None:
    """Gemma 2's config class defaults the soft-caps on; Gemma 3's leaves them off."""
    if architecture not in GEMMA_ARCHITECTURES:
        return None
    return d.get(name, gemma2_default if architecture == "Gemma2ForCausalLM" else None)


def _check_activation(d: dict[str, Any], architecture: str) -> None:
    if architecture in GEMMA_ARCHITECTURES:
        act = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
        expected: tuple[str, ...] = ("gelu_pytorch_tanh", "gelu_tanh")
    else:
        act, expected = d.get("hidden_act", "silu"), ("silu",)
    if act not in expected:
        raise ValueError(f"hidden_act: {act!r} is not supported for {architecture} (supported: {', '.join(expected)})")
