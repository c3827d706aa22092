"""Read a llama.cpp GGUF file into a ModelConfig and float32 weights under Hugging Face names.

Quantized tensors are dequantized once at load time (the engine runs unquantized weights). Tensor names
are translated with gguf-py's own TensorNameMap, the table llama.cpp's convert_hf_to_gguf.py names
them by, so each architecture's names (Gemma's four norms, Phi-3's fused tensors) come from one place.
What the converter changed is undone: Llama's q/k row permutation, Gemma's norms stored as 1 + w.
"""

from __future__ import annotations

import functools
import math
import os
from typing import TYPE_CHECKING, Any

import gguf
import numpy as np

from iterserve.server.model.gguf_file import GGUFFile
from iterserve.server.model.model_config import ModelConfig

if TYPE_CHECKING:  # torch loads with the weights: the server's tokenizer reads GGUF metadata without it
    import torch

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                  "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
_GEMMA = ("gemma2", "gemma3")
# llama.cpp stores Llama-3 rope scaling as precomputed per-frequency divisors, not as parameters.
_ROPE_FREQS = "rope_freqs.weight"
# Phi-3's LongRoPE factors: present only in files whose rope this engine does not implement
_LONGROPE = ("rope_factors_long.weight", "rope_factors_short.weight")
# llama.cpp runs Gemma's largest models (by layer count) with query_pre_attn_scalar = hidden / heads,
# which is what their HF configs say; every other size uses head_dim. The GGUF does not store it.
_GEMMA_HIDDEN_PER_HEAD_SCALE = {"gemma2": 46, "gemma3": 62}


def open_gguf(path: str) -> GGUFFile:
    try:
        stat = os.stat(path)
        return _cached_reader(os.path.realpath(path), stat.st_mtime_ns, stat.st_size)
    except Exception as exc:  # the reader raises whatever numpy/struct hit on a bad file
        raise ValueError(f"model: GGUF file {path} could not be read (corrupt or truncated?): {exc}") from exc


@functools.lru_cache(maxsize=2)
def _cached_reader(path: str, mtime_ns: int, size: int) -> GGUFFile:
    """The model and its tokenizer are loaded from the same file (in-process), so read it once. The key
    includes mtime and size so a rewritten file is read afresh."""
    return GGUFFile(path)


def metadata(reader: GGUFFile, key: str, default: Any = None) -> Any:
    """A metadata value as a Python object (str, int, float, bool or list), or `default`."""
    return reader.metadata.get(key, default)


def load_gguf(path: str) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    reader = open_gguf(path)
    tensors = {t.name: t for t in reader.tensors}
    arch, config = _config(reader, tensors, path)
    names = _gguf_names(arch, config)
    unknown = sorted(set(tensors) - set(names.values()) - {_ROPE_FREQS})
    if unknown:
        raise ValueError(f"model: GGUF tensor {unknown[0]} is not a known {arch} tensor")
    weights = {}
    for hf_name, name in names.items():
        if name not in tensors:
            continue  # check_weights names what is missing
        data = _dequantize(tensors[name], path)
        if arch == "llama" and ".attn_q." in name:
            data = _unpermute(data, config.num_attention_heads)
        elif arch == "llama" and ".attn_k." in name:
            data = _unpermute(data, config.num_key_value_heads)
        elif arch in _GEMMA and hf_name.endswith("norm.weight"):
            data = data - 1.0  # the converter stored Gemma's (1 + w); the HF tensor is w
        weights[hf_name] = data
    return config, weights


def _gguf_names(arch: str, config: ModelConfig) -> dict[str, str]:
    """HF checkpoint name -> GGUF tensor name for every tensor the model needs."""
    from iterserve.server.model.registry import model_class

    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    table = gguf.get_tensor_name_map(arch_id, config.num_hidden_layers)
    names = {}
    for hf_name in model_class(config).checkpoint_shapes(config):
        base, suffix = hf_name.rsplit(".", 1)
        name = table.get_name(base)
        if name is None:  # a model/table mismatch, not a user's error
            raise ValueError(f"model: no GGUF name for tensor {hf_name} of architecture {arch}")
        names[hf_name] = f"{name}.{suffix}"
    return names


def _dequantize(tensor: Any, path: str) -> torch.Tensor:
    # GGUF lists dimensions fastest-first; torch wants them slowest-first.
    shape = tuple(int(n) for n in reversed(tensor.shape))
    try:
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)
    except Exception as exc:
        raise ValueError(
            f"model: GGUF file {path} could not be read (corrupt or truncated?): tensor {tensor.name}: {exc}"
        ) from exc
    # Unquantized tensors come back as read-only views of the memory-mapped file.
    if not array.flags.writeable or array.dtype != np.float32:
        array = array.astype(np.float32)
    import torch

    return torch.from_numpy(array)


def _unpermute(weights: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf.py's q/k row permutation for Llama, which regroups each head's rotary
    halves into interleaved pairs (llama.cpp's rope is the GPT-J style). Same as transformers'
    `reverse_permute_weights`; k is permuted per KV head, so it gets `num_key_value_heads`."""
    dim = weights.shape[0] // n_head // 2
    w = weights.reshape(n_head, dim, 2, *weights.shape[1:])
    return w.transpose(1, 2).reshape(weights.shape).contiguous()


def _config(reader: GGUFFile, tensors: dict[str, Any], path: str) -> tuple[str, ModelConfig]:
    arch = metadata(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(
            f"model: general.architecture {arch!r} in {path} is not supported; supported: {', '.join(_ARCHITECTURES)}"
        )

    def required(key: str) -> Any:
        value = metadata(reader, f"{arch}.{key}")
        if value is None:
            raise ValueError(f"model: GGUF metadata {arch}.{key} is missing from {path}")
        if isinstance(value, list):
            raise ValueError(f"model: GGUF metadata {arch}.{key} varies per layer, which is not supported")
        return value

    hidden = required("embedding_length")
    heads = required("attention.head_count")
    head_dim = metadata(reader, f"{arch}.attention.key_length") or hidden // heads
    rotary_dim = metadata(reader, f"{arch}.rope.dimension_count", head_dim)
    if rotary_dim != head_dim:
        raise ValueError(f"model: {arch}.rope.dimension_count {rotary_dim} != head_dim {head_dim} "
                         "(partial rotary) is not supported")
    if "token_embd.weight" not in tensors:
        raise ValueError(f"model: GGUF file {path} is missing tensor token_embd.weight")
    vocab = metadata(reader, f"{arch}.vocab_size") or int(tensors["token_embd.weight"].shape[1])

    eos_ids = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        token = metadata(reader, f"tokenizer.ggml.{key}")
        if token is not None and token not in eos_ids:
            eos_ids.append(token)

    if any(name in tensors for name in _LONGROPE):
        raise ValueError(f"model: {path} uses Phi-3 LongRoPE scaling (rope_factors_long/short), which is not supported")
    intermediate, layers = required("feed_forward_length"), required("block_count")
    window = metadata(reader, f"{arch}.attention.sliding_window")
    return arch, ModelConfig(
        architecture=_ARCHITECTURES[arch],
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=metadata(reader, f"{arch}.attention.head_count_kv") or heads,
        head_dim=head_dim,
        rms_norm_eps=float(required("attention.layer_norm_rms_epsilon")),
        rope_theta=float(metadata(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(reader, arch, tensors, head_dim),
        max_position_embeddings=required("context_length"),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias=arch == "qwen2" or "blk.0.attn_q.bias" in tensors,
        bos_token_id=metadata(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=eos_ids,
        # Phi-3's window caps the context (as for HF checkpoints); Gemma's applies to its local layers
        sliding_window=window if arch in ("phi3", *_GEMMA) else None,
        layer_types=_gemma_layer_types(reader, arch, layers),
        qk_norm=arch in ("qwen3", "gemma3"),
        query_pre_attn_scalar=(hidden / heads if layers == _GEMMA_HIDDEN_PER_HEAD_SCALE[arch] else head_dim)
        if arch in _GEMMA else None,
        attn_logit_softcapping=metadata(reader, f"{arch}.attn_logit_softcapping"),
        final_logit_softcapping=metadata(reader, f"{arch}.final_logit_softcapping"),
        # llama.cpp's own default for Gemma 3's local layers when the file does not say
        local_rope_theta=float(metadata(reader, f"{arch}.rope.freq_base_swa", 10000.0)) if arch == "gemma3" else None,
    )


def _gemma_layer_types(reader: GGUFFile, arch: str, layers: int) -> tuple[str, ...] | None:
    """Local/global layers as llama.cpp runs them: Gemma 2 alternates from a local first layer; Gemma 3
    has `sliding_window_pattern` (one flag per layer, or a period), five local then one global if absent."""
    if arch not in _GEMMA:
        return None
    pattern = metadata(reader, f"{arch}.attention.sliding_window_pattern", 2 if arch == "gemma2" else 6)
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise ValueError(f"model: GGUF metadata {arch}.attention.sliding_window_pattern has {len(pattern)} "
                             f"entries for {layers} layers")
        return tuple("sliding_attention" if local else "full_attention" for local in pattern)
    return tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers))


def _rope_scaling(reader: GGUFFile, arch: str, tensors: dict[str, Any], head_dim: int) -> dict | None:
    if _ROPE_FREQS in tensors:
        return _llama3_rope_scaling(_dequantize(tensors[_ROPE_FREQS], "rope_freqs"), reader, arch, head_dim)
    kind = metadata(reader, f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    factor = metadata(reader, f"{arch}.rope.scaling.factor")
    if kind not in ("linear", "yarn") or factor is None:
        raise ValueError(f"model: {arch}.rope.scaling.type {kind!r} (factor {factor}) is not supported")
    scaling = {"rope_type": kind, "factor": float(factor)}
    original = metadata(reader, f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = original
    return scaling


def _llama3_rope_scaling(freqs: torch.Tensor, reader: GGUFFile, arch: str, head_dim: int) -> dict:
    """Recover transformers' llama3 rope parameters from llama.cpp's divisors. The file keeps only the
    divisors, so assume the parameters every Llama 3.x release uses (only the factor varies) and check
    that they reproduce the divisors exactly, refusing the file otherwise."""
    theta = float(metadata(reader, f"{arch}.rope.freq_base", 10000.0))
    scaling = {
        "rope_type": "llama3",
        "factor": float(freqs.max()),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    import torch

    if not torch.allclose(freqs, llama3_rope_divisors(scaling, theta, head_dim), rtol=1e-4):
        raise ValueError("model: GGUF tensor rope_freqs does not match Llama-3 rope scaling; not supported")
    return scaling


def llama3_rope_divisors(scaling: dict, theta: float, head_dim: int) -> torch.Tensor:
    """What convert_hf_to_gguf.py writes as rope_freqs: per rotary pair, the divisor of its frequency."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = original / low, original / high
    divisors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi / (1.0 / theta ** (i / head_dim))
        if wavelen < high_wavelen:
            divisors.append(1.0)
        elif wavelen > low_wavelen:
            divisors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    import torch

    return torch.tensor(divisors, dtype=torch.float32)
