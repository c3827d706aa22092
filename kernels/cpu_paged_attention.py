"""Paged decode attention on the CPU as a C++ kernel (csrc/paged_decode_attention.cpp).

The torch path (paged_attention_torch.py) attends single-query requests by gathering whole KV blocks
with `index_select` into padded tensors and running masked SDPA over them: every step copies each
request's whole context twice (K and V), padding included, before reading it again. Profiled, the
gathers and the SDPA took ~21% of a 50 s CPU benchmark. The kernel walks each request's block table
in place instead: one pass over its K and V blocks, the GQA query heads of each KV head together, and
an fp32 online softmax; nothing is copied, padded or masked. `write_kv` puts the step's new K/V rows in
their slots, in place of two `index_copy_` calls a layer.

q and the caches are float32 or bfloat16, all of one dtype (`serves` says whether a call's are). A bf16
cache is widened to fp32 as it is read, so it halves the bytes the kernel streams, which is most of its
time; scores, softmax and accumulators are fp32 either way, and the output, in q's dtype, is rounded
once. Other dtypes take the torch path.

Built on first use by kernels/cpu_extension.py (cached per torch version and CPU; a failed build is
logged once and leaves the torch path serving).

ITERSERVE_CPU_ATTENTION=torch forces the torch path, without building anything: the A/B comparison
against the kernel, and a kill switch. It is read on every call, so it can be flipped in-process.
"""

from __future__ import annotations

import torch

from iterserve.kernels.cpu_extension import CppExtension

ENV_VAR = "ITERSERVE_CPU_ATTENTION"

_extension = CppExtension("iterserve_paged_decode_attention", "paged_decode_attention.cpp", ENV_VAR,
                          "C++ CPU paged attention")
# Prefill chunks: torch's SDPA on CPU ran head_dim-64 attention at ~90 GFLOP/s on two cores, which made
# attention more than half of a long prompt's prefill in bf16 (its linears run at ~900).
# ITERSERVE_CPU_PREFILL_ATTENTION=torch turns this one off alone (the A/B of the prefill kernel);
# ITERSERVE_CPU_ATTENTION=torch turns off both.
PREFILL_ENV_VAR = "ITERSERVE_CPU_PREFILL_ATTENTION"
_prefill_extension = CppExtension("iterserve_paged_prefill_attention", "paged_prefill_attention.cpp",
                                  PREFILL_ENV_VAR, "C++ CPU paged prefill attention")


def available() -> bool:
    """Whether the kernel serves: not forced off by ITERSERVE_CPU_ATTENTION=torch, and built/loaded.

    The first call builds (or loads the cached build), which takes a while; later calls are cheap.
    """
    return _extension.available()


def prefill_available() -> bool:
    """Whether the prefill kernel serves (as `available()`, for csrc/paged_prefill_attention.cpp)."""
    return _prefill_extension.available()


SERVED_DTYPES = (torch.float32, torch.bfloat16)


def serves(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernels take this layer's q and cache: CPU, one served dtype, and `available()`."""
    return (q.device.type == "cpu" and q.dtype in SERVED_DTYPES and k_cache.dtype == q.dtype
            and k_cache.device.type == "cpu" and available())


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                           scale: float) -> torch.Tensor:
    """One query per request, attending to its whole context straight from the paged cache.

    q: [n, num_heads, head_dim]; k_cache, v_cache: [num_blocks * block_size, num_kv_heads, head_dim];
    block_tables: [n, width] block ids (columns past a context are never read); context_lens: [n], the
    tokens each query attends to, its own included. Returns [n, num_heads, head_dim] in q's dtype. CPU,
    q and the caches all float32 or all bfloat16; call only when `serves(q, k_cache)`.
    """
    assert _extension.module is not None, "paged_decode_attention called before available() returned True"
    return _extension.module.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens,
                                                    block_size, scale)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k_cache[slot_mapping[i]] = k[i] and v_cache[slot_mapping[i]] = v[i]; k, v: [n, num_kv_heads,
    head_dim]. CPU, all float32 or all bfloat16; call only when `serves(k, k_cache)`."""
    assert _extension.module is not None, "write_kv called before available() returned True"
    _extension.module.write_kv(k, v, k_cache, v_cache, slot_mapping)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            query_start: torch.Tensor, query_lens: torch.Tensor, context_lens: torch.Tensor,
                            block_tables: torch.Tensor, block_size: int, scale: float, out: torch.Tensor) -> None:
    """Causal attention of a step's multi-query requests, straight from the paged cache, into `out`.

    q, out: [num_tokens, num_heads, head_dim] (q's rows may be strided; out contiguous); request j's
    queries are rows [query_start[j], query_start[j] + query_lens[j]), the last query_lens[j] of its
    context_lens[j] tokens, whose K/V (already written) the caches hold through block_tables[j]. Only
    those rows of `out` are written. Call only when `serves(q, k_cache)` and `prefill_available()`.
    """
    assert _prefill_extension.module is not None, "paged_prefill_attention called before prefill_available()"
    _prefill_extension.module.paged_prefill_attention(q, k_cache, v_cache, query_start, query_lens, context_lens,
                                                      block_tables, block_size, scale, out)
