"""Paged decode attention on the CPU as a C++ kernel (csrc/paged_decode_attention.cpp).

The torch path (paged_attention_torch.py) attends single-query requests by gathering whole KV blocks
with `index_select` into padded tensors and running masked SDPA over them: every step copies each
request's whole context twice (K and V), padding included, before reading it again. Profiled, the
gathers and the SDPA took ~21% of a 50 s CPU benchmark. The kernel walks each request's block table
in place instead: one pass over its K and V rows, per (request, KV head) with the GQA query heads of
that KV head together, and an fp32 online softmax; nothing is copied, padded or masked.

It is JIT-built with `torch.utils.cpp_extension.load` (g++ and ninja, `-O3 -march=native`) on first
use, under ~/.cache/iterserve/torch_extensions/<torch version>/<CPU tag>; torch's file lock serializes
concurrent builds from several processes, and later processes only load the cached library. When the
build fails (no compiler, say), `available()` is False, the reason is logged once, and the torch path
serves. float32 only: other dtypes take the torch path.

ITERSERVE_CPU_ATTENTION=torch forces the torch path, without building anything: the A/B comparison
against the kernel, and a kill switch. It is read on every call, so it can be flipped in-process.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger("iterserve.kernels")

ENV_VAR = "ITERSERVE_CPU_ATTENTION"
_SOURCE = Path(__file__).parent / "csrc" / "paged_decode_attention.cpp"

_lock = threading.Lock()
_module: ModuleType | None = None
_failed = False


def _cpu_tag() -> str:
    """-march=native code can crash on another CPU: a home directory shared by several machines must
    not hand one machine's build to another."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return hashlib.sha1(f"{platform.machine()} {flags}".encode()).hexdigest()[:12]


def _build() -> ModuleType:
    from torch.utils.cpp_extension import load

    build_dir = Path.home() / ".cache" / "iterserve" / "torch_extensions" / torch.__version__ / _cpu_tag()
    build_dir.mkdir(parents=True, exist_ok=True)
    # -fopenmp: at::parallel_for runs on torch's OpenMP pool only when the including code is compiled
    # with OpenMP (the soname resolves to the libgomp torch already loaded); it also enables `omp simd`.
    flags = ["-O3", "-march=native", "-fopenmp"]
    return load(name="iterserve_paged_decode_attention", sources=[str(_SOURCE)], extra_cflags=flags,
                extra_ldflags=["-fopenmp"], build_directory=str(build_dir))


def available() -> bool:
    """Whether the kernel serves: not forced off by ITERSERVE_CPU_ATTENTION=torch, and built/loaded.

    The first call builds (or loads the cached build), which takes a while; later calls are cheap.
    """
    global _module, _failed
    if os.environ.get(ENV_VAR) == "torch":
        return False
    if _module is not None or _failed:
        return _module is not None
    with _lock:
        if _module is None and not _failed:
            try:
                _module = _build()
            except Exception as e:  # any build or load failure leaves the torch path serving
                _failed = True
                logger.warning("C++ CPU paged attention unavailable, using the torch path: %s", e)
    return _module is not None


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                           scale: float) -> torch.Tensor:
    """One query per request, attending to its whole context straight from the paged cache.

    q: [n, num_heads, head_dim]; k_cache, v_cache: [num_blocks * block_size, num_kv_heads, head_dim];
    block_tables: [n, width] block ids (columns past a context are never read); context_lens: [n], the
    tokens each query attends to, its own included. Returns [n, num_heads, head_dim]. CPU float32;
    call only when `available()`.
    """
    assert _module is not None, "paged_decode_attention called before available() returned True"
    return _module.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, block_size,
                                          scale)
