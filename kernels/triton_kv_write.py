"""KV write in Triton: scatter the step's new K and V rows into their paged-cache slots.

The cache is flat and slot-indexed, [num_blocks * block_size, num_kv_heads, head_dim]; a token's K (or V)
is one contiguous row of num_kv_heads * head_dim values there, and in the step's k/v as well (their
heads are adjacent columns of the fused qkv projection). A negative slot means "write nothing": the
padded rows of a CUDA-graph batch carry -1.
"""

from __future__ import annotations

import torch
import triton.language as tl

from iterserve.kernels.triton_jit import lazy_jit, next_power_of_2

_MAX_BLOCK = 1024


@lazy_jit
def _kv_write_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     k_stride, v_stride, cache_stride,
                     ROW: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(slot_ptr + token).to(tl.int64)  # int64: slot * row overflows int32 in large caches
    mask = cols < tl.where(slot >= 0, ROW, 0)
    k = tl.load(k_ptr + token * k_stride + cols, mask=mask)
    v = tl.load(v_ptr + token * v_stride + cols, mask=mask)
    tl.store(k_cache_ptr + slot * cache_stride + cols, k, mask=mask)
    tl.store(v_cache_ptr + slot * cache_stride + cols, v, mask=mask)


def write_kv_triton(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """k, v: [num_tokens, num_kv_heads, head_dim] (rows may be strided); slot_mapping: [num_tokens]."""
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    row = k.shape[1] * k.shape[2]
    for t in (k, v):
        if t.stride(2) != 1 or t.stride(1) != t.shape[2]:
            raise ValueError("write_kv_triton: each token's K/V heads must be one contiguous row")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("write_kv_triton: the KV cache must be contiguous")
    block = min(next_power_of_2(row), _MAX_BLOCK)
    grid = (num_tokens, -(-row // block))
    _kv_write_kernel[grid](k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0), row,
                           ROW=row, BLOCK=block)
