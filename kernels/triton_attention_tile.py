"""One step of paged attention shared by the decode and prefill kernels: a tile of keys through the
block table, the causal mask and an fp32 online-softmax update (exp2; scores pre-scaled by log2 e).

Rows are queries (the GQA group's heads for a decode, a tile of positions for a prefill), each at
position q_pos; keys are the positions [tile_start, tile_start + BLOCK_N) that lie before `end`.
"""

from __future__ import annotations

import triton.language as tl

from iterserve.kernels.triton_jit import lazy_jit


@lazy_jit
def attend_tile(q, q_pos, m, l_sum, acc, tile_start, end, table, k_cache_ptr, v_cache_ptr, kv_head,
                cache_stride_tok, cache_stride_head, qk_scale,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                DOT_PRECISION: tl.constexpr):
    pos = tile_start + tl.arange(0, BLOCK_N)
    valid = pos < end
    d = tl.arange(0, BLOCK_D)
    # int64: slot * stride overflows int32 in caches of a few GB
    block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    slot = block * BLOCK_SIZE + pos % BLOCK_SIZE
    kv_offsets = slot[:, None] * cache_stride_tok + kv_head * cache_stride_head + d[None, :]
    kv_mask = valid[:, None] & (d < HEAD_DIM)[None, :]
    k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    # callers start at a position every row sees, so each row has a finite maximum from the first tile
    s = tl.where(valid[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_sum = l_sum * alpha + tl.sum(p, 1)
    v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_sum, acc
