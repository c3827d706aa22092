"""Paged attention in plain torch: the CPU path, and the reference the Triton kernels are tested against.

K/V live in a flat slot-indexed cache per layer, [num_blocks * block_size, num_kv_heads, head_dim];
a request's context is gathered through its block table, one whole block (a contiguous row of the
cache viewed as [num_blocks, block_size * num_kv_heads * head_dim]) per index. On the CPU in float32 or
bfloat16, single-query requests go to the C++ decode kernel of cpu_paged_attention.py instead, and
multi-query ones (prefill chunks) all together to its prefill kernel; both read the cache in place. The
gather + SDPA below stays as their reference and their fallback.

Layers with a sliding window or a score soft-cap (Gemma) always take the gather path: the window is
one more mask term, and soft-capped scores go through the explicit softmax of `_softcapped_attention`
(SDPA has no soft-cap); the C++ kernels implement neither.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from iterserve.kernels import cpu_paged_attention
from iterserve.kernels.attention_metadata import AttentionMetadata


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter the step's new K/V ([num_tokens, num_kv_heads, head_dim]) into their cache slots."""
    k_cache.index_copy_(0, slot_mapping, k)
    v_cache.index_copy_(0, slot_mapping, v)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim]; k, v: the same tokens' [num_tokens, num_kv_heads, head_dim].

    Writes k, v into the cache, then returns attention output shaped like q. sliding_window: each query
    sees only the keys less than this many positions behind it (itself included), as in HF; softcap:
    scores become softcap * tanh(scores / softcap) before the mask and softmax.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    use_kernel = cpu_paged_attention.serves(q, k_cache)
    if use_kernel:
        cpu_paged_attention.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    else:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    if sliding_window is not None or softcap is not None:
        return _masked_paged_attention(q, k, v, k_cache, v_cache, meta, scale, sliding_window, softcap)
    if use_kernel and meta.decode_only:  # every token is its request's only query: no gather, no scatter
        g = meta.single_groups[0]
        return cpu_paged_attention.paged_decode_attention(q, k_cache, v_cache, g.context_blocks, g.context_lens,
                                                          meta.block_size, scale)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous: q is a strided view

    k_blocks = k_cache.view(-1, meta.block_size * num_kv_heads * head_dim)
    v_blocks = v_cache.view(-1, meta.block_size * num_kv_heads * head_dim)
    for g in meta.single_groups:
        if use_kernel:
            # Straight from the paged cache: no gathered K/V copies, no padding, no mask.
            o = cpu_paged_attention.paged_decode_attention(
                q.index_select(0, g.token_index), k_cache, v_cache, g.context_blocks, g.context_lens,
                meta.block_size, scale)
            out.index_copy_(0, g.token_index, o)
            continue
        batch = g.context_blocks.shape[0]
        ctx = g.context_mask.shape[-1]
        # One query per request: the query heads sharing a KV head become that head's rows, so GQA
        # needs no repeated K/V: [batch, kv_heads, group, head_dim] against [batch, kv_heads, ctx, dim].
        qs = q.index_select(0, g.token_index).view(batch, num_kv_heads, group, head_dim)
        flat = g.context_blocks.reshape(-1)  # index_select: much faster than advanced indexing
        ks = k_blocks.index_select(0, flat).view(batch, ctx, num_kv_heads, head_dim).transpose(1, 2)
        vs = v_blocks.index_select(0, flat).view(batch, ctx, num_kv_heads, head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=g.context_mask, scale=scale)
        out.index_copy_(0, g.token_index, o.reshape(batch, num_heads, head_dim))

    if use_kernel and meta.prefill is not None and cpu_paged_attention.prefill_available():
        p = meta.prefill  # every multi-query request in one call, straight from the cache
        cpu_paged_attention.paged_prefill_attention(q, k_cache, v_cache, p.query_start, p.query_lens,
                                                    p.context_lens, p.block_tables, meta.block_size, scale, out)
        return out
    for mq in meta.multi:
        # [1, heads, n, dim]: with a batch dimension (and GQA left to SDPA rather than repeated K/V heads)
        # torch's CPU SDPA takes its flash kernel even with a mask; 3-D inputs fell to the math path,
        # which took half of a chunked prefill's step
        qm = q[mq.start : mq.start + mq.num_query].transpose(0, 1)[None]
        if mq.context_blocks is None:
            km = k[mq.start : mq.start + mq.num_query]
            vm = v[mq.start : mq.start + mq.num_query]
        else:
            assert mq.mask is not None  # a chunk after earlier context always has its mask
            ctx = mq.mask.shape[-1]
            km = k_blocks.index_select(0, mq.context_blocks).view(-1, num_kv_heads, head_dim)[:ctx]
            vm = v_blocks.index_select(0, mq.context_blocks).view(-1, num_kv_heads, head_dim)[:ctx]
        o = F.scaled_dot_product_attention(
            qm, km.transpose(0, 1)[None], vm.transpose(0, 1)[None], attn_mask=mq.mask, is_causal=mq.mask is None,
            scale=scale, enable_gqa=group > 1,
        )
        out[mq.start : mq.start + mq.num_query] = o[0].transpose(0, 1)
    return out


def _masked_paged_attention(q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                            sliding_window: int | None, softcap: float | None) -> torch.Tensor:
    """paged_attention's gather path with a sliding window and/or soft-cap; K/V already written."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    out = torch.empty_like(q)
    k_blocks = k_cache.view(-1, meta.block_size * num_kv_heads * head_dim)
    v_blocks = v_cache.view(-1, meta.block_size * num_kv_heads * head_dim)
    for g in meta.single_groups:
        batch = g.context_blocks.shape[0]
        mask = g.context_mask  # [batch, 1, 1, ctx]
        if sliding_window is not None:  # the query sits at context_len - 1
            key_pos = torch.arange(mask.shape[-1], device=q.device)
            mask = mask & (key_pos[None, :] > g.context_lens[:, None] - 1 - sliding_window)[:, None, None, :]
        flat = g.context_blocks.reshape(-1)
        ks = k_blocks.index_select(0, flat).view(batch, -1, num_kv_heads, head_dim).transpose(1, 2)
        vs = v_blocks.index_select(0, flat).view(batch, -1, num_kv_heads, head_dim).transpose(1, 2)
        qs = q.index_select(0, g.token_index).view(batch, num_heads, 1, head_dim)
        o = _attend(qs, ks, vs, mask, scale, softcap)
        out.index_copy_(0, g.token_index, o.reshape(batch, num_heads, head_dim))
    for mq in meta.multi:
        qm = q[mq.start : mq.start + mq.num_query].transpose(0, 1)[None]
        if mq.context_blocks is None:
            km, vm = k[mq.start : mq.start + mq.num_query], v[mq.start : mq.start + mq.num_query]
        else:
            assert mq.mask is not None  # a chunk after earlier context always has its mask
            ctx = mq.mask.shape[-1]
            km = k_blocks.index_select(0, mq.context_blocks).view(-1, num_kv_heads, head_dim)[:ctx]
            vm = v_blocks.index_select(0, mq.context_blocks).view(-1, num_kv_heads, head_dim)[:ctx]
        ctx = km.shape[0]
        query_pos = torch.arange(ctx - mq.num_query, ctx, device=q.device)[:, None]
        key_pos = torch.arange(ctx, device=q.device)[None, :]
        mask = key_pos <= query_pos
        if sliding_window is not None:
            mask = mask & (key_pos > query_pos - sliding_window)
        o = _attend(qm, km.transpose(0, 1)[None], vm.transpose(0, 1)[None], mask, scale, softcap)
        out[mq.start : mq.start + mq.num_query] = o[0].transpose(0, 1)
    return out


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
            softcap: float | None) -> torch.Tensor:
    """q [b, heads, n, d] against k, v [b, kv_heads, ctx, d] under a boolean mask broadcast to
    [b, heads, n, ctx]. Without a soft-cap, SDPA; with one, HF's eager arithmetic: scores in q's dtype,
    capped, softmax in fp32, rounded back to q's dtype before the product with v."""
    group = q.shape[1] // k.shape[1]
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=group > 1)
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)
