"""Paged decode attention in Triton: one query token per sequence, read K/V through its block table.

A program serves one (sequence, KV head, split): the GROUP query heads that share the KV head are
the rows of one tile, so each K/V row is read once for all of them (GQA without repeating K/V). The
context is walked in tiles of BLOCK_N tokens, each token's cache row found through the block table,
with an fp32 online softmax (exp2). At long contexts and small batches the context is cut into
`num_splits` ranges run in parallel; each writes its partial output and log-sum-exp, and a merge
kernel combines them. A context of 0 (the padded rows of a CUDA-graph batch) gives zeros.
"""

from __future__ import annotations

import torch
import triton.language as tl

from iterserve.kernels.triton_attention_tile import attend_tile
from iterserve.kernels.triton_jit import interpreting, lazy_jit, next_power_of_2

_LOG2E = 1.4426950408889634
# Below this many tokens per split, the merge costs more than the parallelism gains.
_MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 64


@lazy_jit(do_not_specialize=("num_splits", "bt_stride"))
def _decode_kernel(out_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
                   token_index_ptr, block_tables_ptr, context_lens_ptr,
                   part_out_ptr, part_lse_ptr,
                   qk_scale, num_splits,
                   q_stride_tok, q_stride_head, out_stride_tok, out_stride_head,
                   cache_stride_tok, cache_stride_head, bt_stride,
                   GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    row = tl.load(token_index_ptr + seq).to(tl.int64)

    # this split's range of the context, in whole tiles
    tiles_per_split = tl.cdiv(tl.cdiv(context_len, BLOCK_N), num_splits)
    start = split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, context_len)

    h = tl.arange(0, BLOCK_H)
    h_mask = h < GROUP
    heads = kv_head * GROUP + h
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + row * q_stride_tok + heads[:, None] * q_stride_head + d[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)

    m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * bt_stride
    q_pos = tl.full([BLOCK_H], 0, dtype=tl.int32) + context_len - 1  # the query is the last position
    for tile_start in range(start, end, BLOCK_N):
        m, l_sum, acc = attend_tile(q, q_pos, m, l_sum, acc, tile_start, end, table, k_cache_ptr, v_cache_ptr,
                                    kv_head, cache_stride_tok, cache_stride_head, qk_scale,
                                    HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N, DOT_PRECISION)

    has_any = l_sum > 0
    acc = acc / tl.where(has_any, l_sum, 1.0)[:, None]
    out_mask = h_mask[:, None] & d_mask[None, :]
    if SPLIT:
        # partials: [num_seqs, num_heads, num_splits, HEAD_DIM] and [num_seqs, num_heads, num_splits]
        part = (seq * tl.num_programs(1) * GROUP + heads).to(tl.int64) * num_splits + split
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=out_mask)
        lse = tl.where(has_any, m + tl.log2(tl.where(has_any, l_sum, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=h_mask)
    else:
        tl.store(out_ptr + row * out_stride_tok + heads[:, None] * out_stride_head + d[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@lazy_jit(do_not_specialize=("num_splits",))
def _merge_kernel(out_ptr, part_out_ptr, part_lse_ptr, token_index_ptr, num_splits,
                  out_stride_tok, out_stride_head,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    row = tl.load(token_index_ptr + seq).to(tl.int64)
    part = (seq * tl.num_programs(1) + head).to(tl.int64) * num_splits
    s = tl.arange(0, BLOCK_S)
    s_mask = s < num_splits
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    lse = tl.load(part_lse_ptr + part + s, mask=s_mask, other=float("-inf"))
    top = tl.maximum(tl.max(lse, 0), -1e30)  # all splits empty (a zero context): weights 0, not NaN
    weight = tl.exp2(lse - top)
    outs = tl.load(part_out_ptr + (part + s)[:, None] * HEAD_DIM + d[None, :],
                   mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    total = tl.sum(weight, 0)
    merged = tl.sum(outs * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + row * out_stride_tok + head * out_stride_head + d, merged.to(out_ptr.dtype.element_ty),
             mask=d_mask)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context_len: int, num_sms: int) -> int:
    """Splits per sequence so that about 4 programs per SM run, never below _MIN_TOKENS_PER_SPLIT
    tokens per split; 1 when the batch alone fills the GPU."""
    programs = max(1, num_seqs * num_kv_heads)
    wanted = -(-4 * num_sms // programs)
    by_length = max(1, max_context_len // _MIN_TOKENS_PER_SPLIT)
    return max(1, min(wanted, by_length, MAX_SPLITS))


def default_block_n() -> int:
    return 16 if interpreting() else 64


def decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                            token_index: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                            block_size: int, scale: float, num_splits: int = 1, block_n: int | None = None) -> None:
    """Attention of one query row per sequence, written into `out` in place.

    q, out: [num_tokens, num_heads, head_dim]; sequence i's query is row token_index[i]. k_cache,
    v_cache: [num_slots, num_kv_heads, head_dim]. block_tables: [num_seqs, max_blocks] (int32 or
    int64); context_lens: [num_seqs], the tokens each sequence attends to, its own included.
    """
    num_seqs = token_index.shape[0]
    if num_seqs == 0:
        return
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    block_n = block_n or default_block_n()
    if q.stride(2) != 1 or out.stride(2) != 1 or not k_cache.is_contiguous() or not v_cache.is_contiguous():
        raise ValueError("decode_attention_triton: head_dim must be the contiguous dimension")
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"decode_attention_triton: num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    split = num_splits > 1
    if split:
        part_out = torch.empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    block_d = max(16, next_power_of_2(head_dim))
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        out, q, k_cache, v_cache, token_index, block_tables, context_lens, part_out, part_lse,
        scale * _LOG2E, num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), block_tables.stride(0),
        GROUP=group, BLOCK_H=max(16, next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, SPLIT=split,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    if split:
        _merge_kernel[(num_seqs, num_heads)](
            out, part_out, part_lse, token_index, num_splits, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=next_power_of_2(num_splits),
        )
