"""Varlen prefill attention over the paged cache in Triton: chunks of queries attend causally.

Sequence i's queries are rows [query_start[i], query_start[i] + query_len[i]) of the step, at positions
[context_len[i] - query_len[i], context_len[i]); their K/V are already written to the cache, with the
earlier context. Every key comes from the cache through the block table, so a fresh prefill, a chunk
of a longer prompt and a recompute after preemption are the same computation.

A program serves one (sequence, query head, tile of BLOCK_M queries); tiles past a sequence's chunk
run no iterations. Keys are walked in tiles of BLOCK_N up to the tile's last query position, with an
fp32 online softmax (exp2) and the causal mask.
"""

from __future__ import annotations

import torch
import triton.language as tl

from iterserve.kernels.triton_attention_tile import attend_tile
from iterserve.kernels.triton_jit import interpreting, lazy_jit, next_power_of_2

_LOG2E = 1.4426950408889634


@lazy_jit(do_not_specialize=("bt_stride",))
def _prefill_kernel(out_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
                    query_start_ptr, query_lens_ptr, context_lens_ptr, block_tables_ptr,
                    qk_scale,
                    q_stride_tok, q_stride_head, out_stride_tok, out_stride_head,
                    cache_stride_tok, cache_stride_head, bt_stride,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    DOT_PRECISION: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    kv_head = head // GROUP
    query_len = tl.load(query_lens_ptr + seq)
    context_len = tl.load(context_lens_ptr + seq)
    first_row = tl.load(query_start_ptr + seq).to(tl.int64)
    past = context_len - query_len  # tokens before this chunk

    i = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    i_mask = i < query_len
    q_pos = past + i
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    rows = first_row + i
    q = tl.load(q_ptr + rows[:, None] * q_stride_tok + head * q_stride_head + d[None, :],
                mask=i_mask[:, None] & d_mask[None, :], other=0.0)

    # keys up to the tile's last query (causal); none at all for a tile past the chunk
    kv_end = tl.where(tile * BLOCK_M < query_len, tl.minimum(context_len, past + (tile + 1) * BLOCK_M), 0)
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * bt_stride
    for tile_start in range(0, kv_end, BLOCK_N):
        m, l_sum, acc = attend_tile(q, q_pos, m, l_sum, acc, tile_start, kv_end, table, k_cache_ptr, v_cache_ptr,
                                    kv_head, cache_stride_tok, cache_stride_head, qk_scale,
                                    HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N, DOT_PRECISION)

    acc = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * out_stride_tok + head * out_stride_head + d[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=i_mask[:, None] & d_mask[None, :])


def default_tiles() -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N): tensor-core sized on the GPU, small under the (slow) interpreter."""
    return (16, 16) if interpreting() else (64, 64)


def prefill_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                             query_start: torch.Tensor, query_lens: torch.Tensor, context_lens: torch.Tensor,
                             block_tables: torch.Tensor, max_query_len: int, block_size: int, scale: float,
                             tiles: tuple[int, int] | None = None) -> None:
    """Causal attention of each sequence's chunk of queries over its cached context, into `out` in place.

    q, out: [num_tokens, num_heads, head_dim]; k_cache, v_cache: [num_slots, num_kv_heads, head_dim];
    query_start, query_lens, context_lens: [num_seqs]; block_tables: [num_seqs, max_blocks].
    max_query_len bounds query_lens (it sizes the grid).
    """
    num_seqs = query_lens.shape[0]
    if num_seqs == 0 or max_query_len == 0:
        return
    num_heads, head_dim = q.shape[1], q.shape[2]
    group = num_heads // k_cache.shape[1]
    block_m, block_n = tiles or default_tiles()
    if q.stride(2) != 1 or out.stride(2) != 1 or not k_cache.is_contiguous() or not v_cache.is_contiguous():
        raise ValueError("prefill_attention_triton: head_dim must be the contiguous dimension")
    grid = (num_seqs, num_heads, -(-max_query_len // block_m))
    _prefill_kernel[grid](
        out, q, k_cache, v_cache, query_start, query_lens, context_lens, block_tables,
        scale * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=max(16, next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=block_n,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
