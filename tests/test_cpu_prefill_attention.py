"""The C++ CPU prefill-attention kernel (every multi-query request of a step in one call, causal, straight
from the paged cache), in float32 and bfloat16, against a per-request float64 computation and against the
torch path's gather + SDPA inside `paged_attention`.

In bf16 with head_dim a multiple of 32, on a CPU with AVX512-BF16, the kernel multiplies p.V with p
rounded to bf16, as torch's bf16 SDPA does (and vLLM's CPU attention): its error is held to SDPA's on the
same inputs. Elsewhere its output is the fp32 result rounded once."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from iterserve.kernels import cpu_paged_attention
from iterserve.kernels.attention_metadata import AttentionMetadata, MultiQuery, PrefillBatch, SingleQueryGroup
from iterserve.kernels.paged_attention_torch import paged_attention
from tests.bf16_support import assert_as_close_as_torch, assert_rounded_once_to_bf16
from tests.paged_cache_support import shuffled_paged_cache

# (query tokens, context tokens): a fresh prefill, chunks after earlier context, the query tile's edges
# (31/32/33/65 queries), the key tile's (63/64/65 keys), two queries, and a long context
CASES = [(5, 5), (2, 2), (31, 40), (32, 32), (33, 100), (65, 65), (63, 63), (7, 64), (40, 65), (48, 300)]


@pytest.fixture
def kernel(monkeypatch):
    monkeypatch.delenv(cpu_paged_attention.ENV_VAR, raising=False)
    if not (cpu_paged_attention.available() and cpu_paged_attention.prefill_available()):
        pytest.skip("the C++ kernels did not build or load (their warning, logged by "
                    "iterserve.kernels.cpu_paged_attention, says why)")


def _step(cases, block_size, num_kv_heads, group, head_dim, dtype, lead=3, seed=0):
    """A step whose first `lead` rows are other tokens (left alone), then each case's queries; caches
    with shuffled, non-increasing block tables; q a strided view of a fused qkv tensor, as the model
    hands it over."""
    gen = torch.Generator().manual_seed(seed)
    tables, k_cache, v_cache = shuffled_paged_cache([c for _, c in cases], block_size, num_kv_heads, head_dim, gen,
                                                    dtype, 3)
    num_heads = num_kv_heads * group
    starts, pos = [], lead
    for n, _ in cases:
        starts.append(pos)
        pos += n
    qkv = torch.randn(pos, num_heads + 2 * num_kv_heads, head_dim, generator=gen).to(dtype)
    q = qkv[:, :num_heads]
    batch = PrefillBatch(query_start=torch.tensor(starts), query_lens=torch.tensor([n for n, _ in cases]),
                         context_lens=torch.tensor([c for _, c in cases]), block_tables=tables,
                         max_query_len=max(n for n, _ in cases))
    return q, k_cache, v_cache, batch


def _reference(q, k_cache, v_cache, batch, block_size, scale):
    """float64, request by request: queries at the context's last positions, each attending to the keys
    up to its own position; GQA by repeating K/V heads."""
    group = q.shape[1] // k_cache.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for j in range(len(batch.query_start)):
        s, n, c = int(batch.query_start[j]), int(batch.query_lens[j]), int(batch.context_lens[j])
        pos = torch.arange(c)
        slots = batch.block_tables[j, pos // block_size] * block_size + pos % block_size
        k = k_cache[slots].double().repeat_interleave(group, dim=1)  # [c, heads, dim]
        v = v_cache[slots].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[s : s + n].double(), k) * scale
        causal = pos[None, :] <= torch.arange(c - n, c)[:, None]
        scores = scores.masked_fill(~causal, float("-inf"))
        out[s : s + n] = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)
    return out


def _torch_bf16_sdpa(q, k_cache, v_cache, batch, block_size, scale):
    """torch's own bf16 attention of each request (its CPU flash kernel), the bar for the kernel's bf16 error."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    for j in range(len(batch.query_start)):
        s, n, c = int(batch.query_start[j]), int(batch.query_lens[j]), int(batch.context_lens[j])
        pos = torch.arange(c)
        slots = batch.block_tables[j, pos // block_size] * block_size + pos % block_size
        causal = pos[None, :] <= torch.arange(c - n, c)[:, None]
        o = F.scaled_dot_product_attention(q[s : s + n].transpose(0, 1)[None], k_cache[slots].transpose(0, 1)[None],
                                           v_cache[slots].transpose(0, 1)[None], attn_mask=causal, scale=scale,
                                           enable_gqa=True)
        out[s : s + n] = o[0].transpose(0, 1).double()
    return out


def _run(q, k_cache, v_cache, batch, block_size, scale):
    out = torch.full(q.shape, 7.0, dtype=q.dtype)  # rows the kernel must not touch keep their 7s
    cpu_paged_attention.paged_prefill_attention(q, k_cache, v_cache, batch.query_start, batch.query_lens,
                                                batch.context_lens, batch.block_tables, block_size, scale, out)
    return out


@pytest.mark.parametrize("head_dim", [64, 128, 32, 40])  # 32, 40: the portable loops
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("block_size", [1, 16])
def test_fp32_matches_the_reference(kernel, block_size, group, head_dim):
    q, k_cache, v_cache, batch = _step(CASES, block_size, 2, group, head_dim, torch.float32)
    scale = head_dim**-0.5
    out = _run(q, k_cache, v_cache, batch, block_size, scale)
    expected = _reference(q, k_cache, v_cache, batch, block_size, scale)
    assert torch.equal(out[:3], torch.full_like(out[:3], 7.0))
    torch.testing.assert_close(out[3:].double(), expected[3:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("head_dim", [64, 128, 40])
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_bf16_is_as_close_as_torch_or_the_reference_rounded_once(kernel, block_size, head_dim, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q, k_cache, v_cache, batch = _step(CASES, block_size, 3, 3, head_dim, torch.bfloat16, seed=head_dim)
        out = _run(q, k_cache, v_cache, batch, block_size, 0.125)
    finally:
        torch.set_num_threads(before)
    assert out.dtype == torch.bfloat16 and torch.equal(out[:3], torch.full_like(out[:3], 7.0))
    expected = _reference(q, k_cache, v_cache, batch, block_size, 0.125)
    if head_dim % 32:
        assert_rounded_once_to_bf16(out[3:], expected[3:], atol=1e-5)
    else:
        assert_as_close_as_torch(out[3:], expected[3:],
                                 _torch_bf16_sdpa(q, k_cache, v_cache, batch, block_size, 0.125)[3:])


def _mixed_step(block_size, dtype):
    """A step as step_inputs builds it: two decodes (one single-query group), a fresh prefill and two
    chunks after earlier context, the step's new K/V still to be written by paged_attention."""
    cases = [(1, 40), (1, 17), (37, 37), (64, 130), (9, 300)]
    q, k_cache, v_cache, batch = _step(cases, block_size, 3, 3, 64, dtype, lead=0)
    num_tokens = q.shape[0]
    gen = torch.Generator().manual_seed(5)
    k = torch.randn(num_tokens, 3, 64, generator=gen).to(dtype)
    v = torch.randn(num_tokens, 3, 64, generator=gen).to(dtype)
    slots, multi = [], []
    for j, (n, c) in enumerate(cases):
        pos = torch.arange(c - n, c)
        slots.append(batch.block_tables[j, pos // block_size] * block_size + pos % block_size)
        if n > 1:
            blocks = None if n == c else batch.block_tables[j, : -(-c // block_size)].contiguous()
            multi.append(MultiQuery(int(batch.query_start[j]), n, blocks, c))
    single = SingleQueryGroup(token_index=torch.tensor([0, 1]), context_blocks=batch.block_tables[:2].contiguous(),
                              context_lens=batch.context_lens[:2], block_size=block_size)
    rows = torch.tensor([2, 3, 4])
    prefill = PrefillBatch(query_start=batch.query_start[rows], query_lens=batch.query_lens[rows],
                           context_lens=batch.context_lens[rows], block_tables=batch.block_tables[rows],
                           max_query_len=64)
    meta = AttentionMetadata(slot_mapping=torch.cat(slots), block_size=block_size, single_groups=[single],
                             multi=multi, prefill=prefill)
    return q, k, v, k_cache, v_cache, meta, batch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16])
def test_paged_attention_takes_the_kernel_and_agrees_with_the_torch_path(kernel, monkeypatch, block_size, dtype):
    q, k, v, k_cache, v_cache, meta, batch = _mixed_step(block_size, dtype)
    calls = []
    real = cpu_paged_attention.paged_prefill_attention
    monkeypatch.setattr(cpu_paged_attention, "paged_prefill_attention", lambda *a: calls.append(1) or real(*a))
    outs, caches = [], []
    for path in ("kernel", "torch"):
        if path == "torch":
            monkeypatch.setenv(cpu_paged_attention.ENV_VAR, "torch")
        kc, vc = k_cache.clone(), v_cache.clone()
        outs.append(paged_attention(q, k, v, kc, vc, meta, 0.125))
        caches.append((kc, vc))
    assert calls == [1]  # one call for every multi-query request, on the kernel path only
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    expected = _reference(q, *caches[0], batch, block_size, 0.125)
    if dtype == torch.float32:
        torch.testing.assert_close(outs[0].double(), expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(outs[1].double(), expected, atol=1e-5, rtol=1e-5)
    else:  # the torch path is torch's bf16 SDPA
        torch.testing.assert_close(outs[1].double(), expected, atol=1e-2, rtol=1e-2)
        assert_as_close_as_torch(outs[0], expected, outs[1].double())


def test_kernel_refuses_bad_inputs(kernel):
    q, k_cache, v_cache, batch = _step([(5, 20), (3, 3)], 16, 2, 2, 32, torch.float32)
    out = torch.empty(q.shape)
    args = (batch.query_start, batch.query_lens, batch.context_lens)

    def call(*, q=q, k=k_cache, args=args, tables=batch.block_tables, out=out):
        cpu_paged_attention.paged_prefill_attention(q, k, v_cache if k.dtype == v_cache.dtype else k, *args, tables,
                                                    16, 1.0, out)

    bad = batch.block_tables.clone()
    bad[0, 1] = k_cache.shape[0] // 16
    with pytest.raises(RuntimeError, match="block id"):
        call(tables=bad)
    with pytest.raises(RuntimeError, match="outside the step or its block table"):
        call(args=(batch.query_start, batch.query_lens, torch.tensor([40, 3])))  # past the table
    with pytest.raises(RuntimeError, match="outside the step or its block table"):
        call(args=(torch.tensor([3, 8 + 20]), batch.query_lens, batch.context_lens))  # rows past the step
    with pytest.raises(RuntimeError, match="share a dtype"):
        call(out=out.bfloat16())
    with pytest.raises(RuntimeError, match="expected float32 or bfloat16"):
        call(q=q.half(), k=k_cache.half(), out=out.half())
