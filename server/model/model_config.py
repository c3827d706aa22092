"""The architecture description the engine needs, read from a Hugging Face `config.json` dict.

Only decoder-only Llama-family models are supported; everything they differ in (GQA, head_dim, biases,
rope scaling, tied embeddings, sliding window) is an explicit field so the model code never has to look
at the raw HF dict.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")

# Older checkpoints name only `model_type`, not `architectures`.
_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
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
    sliding_window: int | None = None

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

        hidden_size = _get(d, "hidden_size")
        num_heads = _get(d, "num_attention_heads")
        if not isinstance(hidden_size, int) or not isinstance(num_heads, int) or num_heads <= 0:
            raise ValueError(f"hidden_size/num_attention_heads: must be integers, got {hidden_size!r}/{num_heads!r}")
        head_dim = d.get("head_dim") or hidden_size // num_heads
        rope_theta, rope_scaling = _rope(d)
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
            # All three architectures' HF config classes default to untied.
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; its config has no flag for them.
            attention_bias=architecture == "Qwen2ForCausalLM" or bool(d.get("attention_bias", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos,
            sliding_window=_sliding_window(d, architecture),
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
        raise ValueError(f"architectures: missing from the model config; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    if archs[0] not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"architectures: {archs[0]!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return archs[0]


def _rope(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """transformers 5 writes `rope_parameters` ({rope_theta, rope_type, ...}); older configs write
    `rope_theta` plus `rope_scaling` (whose key was once `type`, not `rope_type`)."""
    params = dict(d.get("rope_parameters") or {})
    scaling = d.get("rope_scaling") or {k: v for k, v in params.items() if k != "rope_theta"}
    rope_theta = d.get("rope_theta", params.get("rope_theta", 10000.0))
    if not isinstance(scaling, dict):
        raise ValueError(f"rope_scaling: expected an object or null, got {scaling!r}")
    scaling = dict(scaling)
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    if scaling.get("rope_type", "default") == "default":
        return rope_theta, None
    if scaling["rope_type"] == "linear" and "factor" not in scaling:
        raise ValueError("rope_scaling: linear rope scaling needs a factor")
    return rope_theta, scaling


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
    if architecture == "MistralForCausalLM" or window is None:
        return window
    # Qwen2 (as transformers does): the window applies only with use_sliding_window, and then only to
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
    raise ValueError("sliding_window: a sliding window on only some layers (max_window_layers/layer_types) is not supported")
