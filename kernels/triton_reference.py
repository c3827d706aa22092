"""Plain torch references for the Triton kernels, written for clarity, one sequence at a time in fp32.

The tests compare every kernel with these; they share no code with the kernels or with the CPU path
(kernels/paged_attention_torch.py), so a mistake in either shows up as a mismatch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def context_slots(block_table: torch.Tensor, num_tokens: int, block_size: int) -> torch.Tensor:
    """Cache slots of a sequence's first num_tokens positions."""
    pos = torch.arange(num_tokens)
    return block_table.long().cpu()[pos // block_size] * block_size + pos % block_size


def causal_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_table: torch.Tensor, context_len: int, block_size: int,
                               scale: float) -> torch.Tensor:
    """q: the sequence's last q.shape[0] positions, [n, heads, dim]; returns [n, heads, dim] fp32."""
    n, num_heads, _ = q.shape
    group = num_heads // k_cache.shape[1]
    if n == 0:
        return q.float().cpu()
    slots = context_slots(block_table, context_len, block_size)
    k = k_cache.float().cpu()[slots].repeat_interleave(group, dim=1)  # [ctx, heads, dim]
    v = v_cache.float().cpu()[slots].repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float().cpu(), k) * scale
    q_pos = torch.arange(context_len - n, context_len)
    scores = scores.masked_fill(torch.arange(context_len)[None, :] > q_pos[:, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def decode_attention_reference(q, k_cache, v_cache, token_index, block_tables, context_lens, block_size, scale):
    """[num_seqs, heads, dim]: sequence i's query row token_index[i] over its context (zeros if empty)."""
    outs = []
    for i in range(token_index.shape[0]):
        n = int(context_lens[i])
        qi = q[int(token_index[i])].unsqueeze(0)
        if n == 0:
            outs.append(torch.zeros(qi.shape[1:]))
            continue
        outs.append(causal_attention_reference(qi, k_cache, v_cache, block_tables[i], n, block_size, scale)[0])
    return torch.stack(outs)


def prefill_attention_reference(q, k_cache, v_cache, query_start, query_lens, context_lens, block_tables,
                                block_size, scale) -> dict[int, torch.Tensor]:
    """{row: [heads, dim]} for every query row of every sequence's chunk."""
    rows = {}
    for i in range(query_lens.shape[0]):
        start, n = int(query_start[i]), int(query_lens[i])
        o = causal_attention_reference(q[start:start + n], k_cache, v_cache, block_tables[i],
                                       int(context_lens[i]), block_size, scale)
        rows.update({start + j: o[j] for j in range(n)})
    return rows


def write_kv_reference(k, v, k_cache, v_cache, slot_mapping) -> None:
    keep = slot_mapping >= 0
    k_cache[slot_mapping[keep].long()] = k[keep]
    v_cache[slot_mapping[keep].long()] = v[keep]


def add_rms_norm_reference(x, residual, weight, eps):
    """HF's RMSNorm (fp32 inside, weight applied in the input dtype) after the residual add."""
    if residual is not None:
        x = x + residual
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype), x


def rope_reference(qk, positions, cos_cache, sin_cache):
    """HF's rotate-half rotary embedding of [n, heads, dim], in fp32."""
    cos = cos_cache[positions.long()].float()[:, None, :]
    sin = sin_cache[positions.long()].float()[:, None, :]
    x = qk.float()
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def silu_mul_reference(gate_up):
    gate, up = gate_up.float().chunk(2, dim=-1)
    return F.silu(gate) * up
