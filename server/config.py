"""The engine's one configuration object, validated on construction with errors that name the field."""

from __future__ import annotations

import re
from dataclasses import dataclass

from iterserve.common import wire
from iterserve.common.wire import Knobs
from iterserve.server.engine.knobs import make_knobs
from iterserve.server.engine.scheduler import POLICIES
from iterserve.server.errors import InvalidRequestError

DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
LOAD_FORMATS = ("auto", "dummy")
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


@dataclass
class EngineConfig:
    model: str | None = None  # HF model dir or .gguf file; None serves the bundled SmolLM2-135M-Instruct
    dtype: str = "auto"  # auto: bfloat16 on CUDA and on CPUs with native bf16, else float32
    device: str = "auto"  # auto: cuda when available, else cpu
    max_model_len: int | None = None  # prompt + output limit; default: the model's context length
    block_size: int = 16  # tokens per KV block
    # KV pool size: bytes ("2GiB", 2147483648) or a fraction in (0, 1) of the memory left after the
    # weights (device memory on CUDA, available RAM on CPU). None: 0.9 on CUDA, 1 GiB on CPU.
    kv_cache_memory: str | float | int | None = None
    max_num_seqs: int = wire.KNOB_DEFAULTS["max_num_seqs"]  # the live knobs (common/wire.py)
    max_num_batched_tokens: int = wire.KNOB_DEFAULTS["max_num_batched_tokens"]
    prefill_chunk_size: int = wire.KNOB_DEFAULTS["prefill_chunk_size"]
    policy: str = "continuous"  # or "static": the no-iteration-level-batching baseline
    num_threads: int | None = None  # torch CPU threads; None leaves torch's default
    seed: int = 0  # for requests sampled without a seed of their own
    # auto: the Triton kernels on CUDA, torch on CPU (triton on CPU needs TRITON_INTERPRET=1: tests only)
    attention_backend: str = "auto"
    cuda_graphs: bool = True  # replay decode steps as CUDA graphs (CUDA + Triton only); off: --enforce-eager
    load_format: str = "auto"  # or "dummy": the config.json's shape with random weights (benchmarks)
    enable_prefix_caching: bool = True  # reuse the KV blocks of prompt prefixes computed before (vLLM's default)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise InvalidRequestError("dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise InvalidRequestError("attention_backend",
                                      f"must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if self.load_format not in LOAD_FORMATS:
            raise InvalidRequestError("load_format", f"must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        for name in ("cuda_graphs", "enable_prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(name, f"must be true or false, got {getattr(self, name)!r}")
        if self.policy not in POLICIES:
            raise InvalidRequestError("policy", f"must be one of {POLICIES}, got {self.policy!r}")
        for name in ("block_size",):
            check_positive_int(name, getattr(self, name))
        for name in ("max_model_len", "num_threads"):
            if getattr(self, name) is not None:
                check_positive_int(name, getattr(self, name))
        self.initial_knobs()  # validates the three live knobs
        if self.kv_cache_memory is not None:
            parse_memory(self.kv_cache_memory)

    def initial_knobs(self) -> Knobs:
        return make_knobs(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            prefill_chunk_size=self.prefill_chunk_size,
        )


def parse_memory(value: str | float | int, param: str = "kv_cache_memory") -> tuple[str, float]:
    """("fraction", f) for 0 < f < 1, else ("bytes", n). Accepts "2GiB", "512MB", "0.5", 1e9."""
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", value)
        if not m or m.group(2).lower() not in _UNITS:
            raise InvalidRequestError(param, f"expected bytes like '2GiB' or a fraction like 0.5, got {value!r}")
        number = float(m.group(1)) * _UNITS[m.group(2).lower()]
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    else:
        raise InvalidRequestError(param, f"expected bytes or a fraction, got {value!r}")
    if 0 < number < 1:
        return "fraction", number
    if number < 1:
        raise InvalidRequestError(param, f"must be positive, got {value!r}")
    return "bytes", number


def check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidRequestError(name, f"must be an integer >= 1, got {value!r}")
