"""The C++ CPU decode-attention kernel, in float32 and bfloat16, against a per-request float64 torch
computation and against the torch path's gather + SDPA, and the ITERSERVE_CPU_ATTENTION kill switch.

In bf16 with head_dim a multiple of 32, on a CPU with AVX512-BF16, the kernel multiplies p.V with p
rounded to bf16, as torch's bf16 SDPA does (and the prefill kernel): its error is held to SDPA's on the
same inputs. Elsewhere its output is the fp32 result rounded once."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from iterserve.kernels import cpu_paged_attention
from iterserve.kernels.attention_metadata import AttentionMetadata, SingleQueryGroup
from iterserve.kernels.paged_attention_torch import paged_attention
from iterserve.server.runner.step_inputs import _groups_by_context
from tests.bf16_support import assert_as_close_as_torch, assert_rounded_once_to_bf16
from tests.paged_cache_support import shuffled_paged_cache


@pytest.fixture
def kernel(monkeypatch):
    monkeypatch.delenv(cpu_paged_attention.ENV_VAR, raising=False)
    if not cpu_paged_attention.available():
        pytest.skip("the C++ kernel did not build or load (its warning, logged by "
                    "iterserve.kernels.cpu_paged_attention, says why)")


def _lengths(block_size: int) -> list[int]:
    """Edges of a block (a query alone, a block short, exact, one over) and a long context."""
    return sorted({n for n in (1, block_size - 1, block_size, block_size + 1, 300) if n >= 1})


def _random_case(lens: list[int], block_size: int, num_kv_heads: int, group: int, head_dim: int,
                 seed: int = 0, dtype: torch.dtype = torch.float32):
    """Caches with more blocks than the requests use, handed out in shuffled order, so block tables are
    neither contiguous nor increasing; tables padded with block 0. q and the caches in `dtype`."""
    gen = torch.Generator().manual_seed(seed)
    tables, k_cache, v_cache = shuffled_paged_cache(lens, block_size, num_kv_heads, head_dim, gen, dtype, 5)
    q = torch.randn(len(lens), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.long)


def _reference(q, k_cache, v_cache, tables, lens, block_size, scale):
    """Each request on its own in float64: its context's slots, GQA by repeating K/V heads, softmax."""
    group = q.shape[1] // k_cache.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for r, n in enumerate(lens.tolist()):
        pos = torch.arange(n)
        slots = tables[r, pos // block_size] * block_size + pos % block_size
        k = k_cache[slots].double().repeat_interleave(group, dim=1)  # [n, heads, dim]
        v = v_cache[slots].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[r].double(), k) * scale
        out[r] = torch.einsum("hn,nhd->hd", scores.softmax(dim=-1), v)
    return out


def _torch_bf16_sdpa(q, k_cache, v_cache, tables, lens, block_size, scale):
    """torch's own bf16 attention of each request's one query, the bar for the kernel's bf16 error."""
    out = torch.empty(q.shape, dtype=torch.float64)
    for r, n in enumerate(lens.tolist()):
        pos = torch.arange(n)
        slots = tables[r, pos // block_size] * block_size + pos % block_size
        o = F.scaled_dot_product_attention(q[r][:, None][None], k_cache[slots].transpose(0, 1)[None],
                                           v_cache[slots].transpose(0, 1)[None], scale=scale, enable_gqa=True)
        out[r] = o[0, :, 0].double()
    return out


def _assert_bf16_close(out, q, k_cache, v_cache, tables, lens, block_size, scale):
    expected = _reference(q, k_cache, v_cache, tables, lens, block_size, scale)
    if q.shape[-1] % 32:
        assert_rounded_once_to_bf16(out, expected, atol=1e-5)
    else:
        assert_as_close_as_torch(out, expected, _torch_bf16_sdpa(q, k_cache, v_cache, tables, lens, block_size, scale))


@pytest.mark.parametrize("head_dim", [128, 64, 32])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("block_size", [1, 16])
def test_kernel_matches_per_request_reference(kernel, block_size, group, head_dim):
    lens = _lengths(block_size)
    # the same lengths again in another order: a batch of mixed lengths, not sorted
    lens = lens + lens[::-1]
    q, k_cache, v_cache, tables, ctx = _random_case(lens, block_size, 2, group, head_dim)
    scale = head_dim**-0.5
    out = cpu_paged_attention.paged_decode_attention(q, k_cache, v_cache, tables, ctx, block_size, scale)
    assert out.shape == q.shape and out.dtype == torch.float32
    expected = _reference(q, k_cache, v_cache, tables, ctx, block_size, scale)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [128, 64, 32, 40])  # 40: no vector form, the portable loops
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_kernel_bf16_matches_per_request_reference(kernel, block_size, group, head_dim):
    lens = _lengths(block_size)
    lens = lens + lens[::-1]
    q, k_cache, v_cache, tables, ctx = _random_case(lens, block_size, 3, group, head_dim, dtype=torch.bfloat16)
    scale = head_dim**-0.5
    out = cpu_paged_attention.paged_decode_attention(q, k_cache, v_cache, tables, ctx, block_size, scale)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    _assert_bf16_close(out, q, k_cache, v_cache, tables, ctx, block_size, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 5, 300])
def test_write_kv_takes_k_and_v_where_they_lie_in_the_qkv_output(kernel, dtype, n):
    # the model hands over column slices of its qkv projection's output, rows 15 heads apart: they are
    # copied from there, so each cache row must be its own token's heads, not a neighbour's
    gen = torch.Generator().manual_seed(n)
    qkv = torch.randn(n, 15 * 64, generator=gen).to(dtype)
    k, v = qkv[:, 9 * 64: 12 * 64].view(n, 3, 64), qkv[:, 12 * 64:].view(n, 3, 64)
    assert n == 1 or not (k.is_contiguous() or v.is_contiguous())  # one row is contiguous as it lies
    k_cache, v_cache = torch.zeros(512, 3, 64, dtype=dtype), torch.zeros(512, 3, 64, dtype=dtype)
    slots = torch.randperm(512, generator=gen)[:n]
    cpu_paged_attention.write_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache[slots], k) and torch.equal(v_cache[slots], v)
    transposed = torch.randn(3, n, 64, generator=gen).to(dtype).transpose(0, 1)  # heads not contiguous: copied
    cpu_paged_attention.write_kv(transposed, transposed, k_cache, v_cache, slots)
    assert torch.equal(k_cache[slots], transposed)


@pytest.mark.parametrize("threads", [1, 2])  # whole requests per item, or one KV head per item
@pytest.mark.parametrize("n", [1, 15, 16, 17, 300])
def test_kernel_bf16_single_request(kernel, n, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q, k_cache, v_cache, tables, ctx = _random_case([n], 16, 3, 3, 64, seed=n, dtype=torch.bfloat16)
        out = cpu_paged_attention.paged_decode_attention(q, k_cache, v_cache, tables, ctx, 16, 0.125)
    finally:
        torch.set_num_threads(before)
    _assert_bf16_close(out, q, k_cache, v_cache, tables, ctx, 16, 0.125)


def test_kernel_bf16_reads_a_non_contiguous_q(kernel):
    """q as the model hands it over: a view of the fused qkv output's columns."""
    q, k_cache, v_cache, tables, ctx = _random_case([5, 40], 16, 3, 3, 64, dtype=torch.bfloat16)
    qkv = torch.cat([q.flatten(1), torch.zeros(2, 6 * 64, dtype=torch.bfloat16)], dim=1)
    q_view = qkv[:, : 9 * 64].view(2, 9, 64)
    assert not q_view.is_contiguous()
    out = cpu_paged_attention.paged_decode_attention(q_view, k_cache, v_cache, tables, ctx, 16, 0.125)
    assert torch.equal(out, cpu_paged_attention.paged_decode_attention(q, k_cache, v_cache, tables, ctx, 16, 0.125))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_copies_rows_exactly(kernel, dtype):
    gen = torch.Generator().manual_seed(5)
    k_cache, v_cache = torch.zeros(64, 3, 64, dtype=dtype), torch.zeros(64, 3, 64, dtype=dtype)
    k = torch.randn(4, 3, 64, generator=gen).to(dtype)
    v = torch.randn(4, 3, 64, generator=gen).to(dtype)
    slots = torch.tensor([17, 3, 63, 40])
    cpu_paged_attention.write_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache[slots], k) and torch.equal(v_cache[slots], v)
    others = torch.ones(64, dtype=torch.bool)
    others[slots] = False
    assert not k_cache[others].any() and not v_cache[others].any()


@pytest.mark.parametrize("n", [1, 15, 16, 17, 300])
def test_kernel_single_request(kernel, n):
    q, k_cache, v_cache, tables, ctx = _random_case([n], 16, 3, 3, 64, seed=n)
    out = cpu_paged_attention.paged_decode_attention(q, k_cache, v_cache, tables, ctx, 16, 0.125)
    torch.testing.assert_close(out.double(), _reference(q, k_cache, v_cache, tables, ctx, 16, 0.125),
                               atol=1e-5, rtol=1e-5)


def _decode_step(lens: list[int], block_size: int, num_kv_heads: int, group: int, head_dim: int,
                 dtype: torch.dtype = torch.float32):
    """A step of decodes in two single-query groups (as step_inputs builds them), the new tokens' K/V
    still to be written by paged_attention."""
    q, k_cache, v_cache, tables, ctx = _random_case(lens, block_size, num_kv_heads, group, head_dim, dtype=dtype)
    last = ctx - 1
    slots = tables[torch.arange(len(lens)), last // block_size] * block_size + last % block_size
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(len(lens), num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(len(lens), num_kv_heads, head_dim, generator=gen).to(dtype)
    groups = []
    for rows in (torch.arange(0, len(lens), 2), torch.arange(1, len(lens), 2)):
        width = -(-int(ctx[rows].max()) // block_size)
        groups.append(SingleQueryGroup(token_index=rows, context_blocks=tables[rows, :width].contiguous(),
                                       context_lens=ctx[rows], block_size=block_size))
    meta = AttentionMetadata(slot_mapping=slots, block_size=block_size, single_groups=groups, multi=[])
    return q, k, v, k_cache, v_cache, meta, tables, ctx


@pytest.mark.parametrize("block_size", [1, 16])
def test_paged_attention_kernel_matches_torch_path(kernel, monkeypatch, block_size):
    q, k, v, k_cache, v_cache, meta, _, _ = _decode_step([1, 40, 17, 300, 16, 5], block_size, 3, 3, 64)
    got = paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta, 0.125)
    monkeypatch.setenv(cpu_paged_attention.ENV_VAR, "torch")
    expected = paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta, 0.125)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [1, 16])
def test_paged_attention_bf16_kernel_and_torch_path(kernel, monkeypatch, block_size):
    """paged_attention in bf16 takes the kernel (tight against the reference) unless switched to torch,
    whose bf16 SDPA also serves (looser: it rounds its intermediates to bf16)."""
    q, k, v, k_cache, v_cache, meta, tables, ctx = _decode_step([1, 40, 17, 300, 16, 5], block_size, 3, 3, 64,
                                                               dtype=torch.bfloat16)
    outs, caches = [], []
    for path in ("kernel", "torch"):
        if path == "torch":
            monkeypatch.setenv(cpu_paged_attention.ENV_VAR, "torch")
        kc, vc = k_cache.clone(), v_cache.clone()
        outs.append(paged_attention(q, k, v, kc, vc, meta, 0.125))
        caches.append((kc, vc))
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])  # same writes
    expected = _reference(q, *caches[0], tables, ctx, block_size, 0.125)
    assert outs[0].dtype == outs[1].dtype == torch.bfloat16
    _assert_bf16_close(outs[0], q, *caches[0], tables, ctx, block_size, 0.125)
    torch.testing.assert_close(outs[1].double(), expected, atol=1e-2, rtol=1e-2)


def test_other_dtypes_take_the_torch_path(kernel, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the kernel ran on a dtype it does not serve")

    q, k, v, k_cache, v_cache, meta, tables, ctx = _decode_step([3, 20], 16, 2, 2, 32, dtype=torch.float16)
    assert not cpu_paged_attention.serves(q, k_cache)
    assert not cpu_paged_attention.serves(q.bfloat16(), k_cache.float())  # one dtype for all, or none
    assert cpu_paged_attention.serves(q.bfloat16(), k_cache.bfloat16())
    monkeypatch.setattr(cpu_paged_attention, "paged_decode_attention", refuse)
    monkeypatch.setattr(cpu_paged_attention, "write_kv", refuse)
    out = paged_attention(q, k, v, k_cache, v_cache, meta, 0.2)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.double(), _reference(q, k_cache, v_cache, tables, ctx, 16, 0.2),
                               atol=1e-2, rtol=1e-2)


def test_kill_switch_takes_the_torch_path(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the kernel ran with ITERSERVE_CPU_ATTENTION=torch")

    monkeypatch.setenv(cpu_paged_attention.ENV_VAR, "torch")
    monkeypatch.setattr(cpu_paged_attention, "paged_decode_attention", refuse)
    assert not cpu_paged_attention.available()
    q, k, v, k_cache, v_cache, meta, tables, ctx = _decode_step([3, 20], 16, 2, 2, 32)
    out = paged_attention(q, k, v, k_cache, v_cache, meta, 0.2)  # writes k, v into the caches
    torch.testing.assert_close(out.double(), _reference(q, k_cache, v_cache, tables, ctx, 16, 0.2),
                               atol=1e-5, rtol=1e-5)


def test_kernel_refuses_bad_inputs(kernel):
    q, k_cache, v_cache, tables, ctx = _random_case([5, 20], 16, 2, 2, 32)
    with pytest.raises(RuntimeError, match="context_lens"):
        cpu_paged_attention.paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor([5, 33]),
                                                   16, 1.0)
    with pytest.raises(RuntimeError, match="context_lens"):
        cpu_paged_attention.paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor([0, 20]),
                                                   16, 1.0)
    bad = tables.clone()
    bad[1, 1] = k_cache.shape[0] // 16
    with pytest.raises(RuntimeError, match="block id"):
        cpu_paged_attention.paged_decode_attention(q, k_cache, v_cache, bad, ctx, 16, 1.0)
    with pytest.raises(RuntimeError, match="must share a dtype"):
        cpu_paged_attention.paged_decode_attention(q.bfloat16(), k_cache, v_cache, tables, ctx, 16, 1.0)
    with pytest.raises(RuntimeError, match="expected float32 or bfloat16"):
        cpu_paged_attention.paged_decode_attention(q.half(), k_cache.half(), v_cache.half(), tables, ctx, 16, 1.0)
    k = torch.zeros(1, 2, 32)
    with pytest.raises(RuntimeError, match="must all be float32 or all bfloat16"):
        cpu_paged_attention.write_kv(k.bfloat16(), k.bfloat16(), k_cache, v_cache, torch.tensor([0]))


def test_failed_build_falls_back_to_torch_and_warns_once(monkeypatch, caplog):
    def no_compiler():
        raise RuntimeError("no compiler here")

    monkeypatch.delenv(cpu_paged_attention.ENV_VAR, raising=False)
    monkeypatch.setattr(cpu_paged_attention._extension, "module", None)
    monkeypatch.setattr(cpu_paged_attention._extension, "failed", False)
    monkeypatch.setattr(cpu_paged_attention._extension, "_build", no_compiler)
    q, k, v, k_cache, v_cache, meta, tables, ctx = _decode_step([3, 20], 16, 2, 2, 32)
    with caplog.at_level("WARNING", logger="iterserve.kernels"):
        assert not cpu_paged_attention.available()
        out = paged_attention(q, k, v, k_cache, v_cache, meta, 0.2)
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "no compiler here" in caplog.text
    torch.testing.assert_close(out.double(), _reference(q, k_cache, v_cache, tables, ctx, 16, 0.2),
                               atol=1e-5, rtol=1e-5)


def test_single_query_groups_one_for_the_kernel_and_by_context_for_the_padded_path():
    rows, ctx = np.arange(40), np.arange(40)[::-1] + 1
    assert [g.tolist() for g in _groups_by_context(rows, ctx, padded=False)] == [rows.tolist()]
    groups = _groups_by_context(rows, ctx, padded=True)
    assert [len(g) for g in groups] == [20, 20] and ctx[groups[0]].max() < ctx[groups[1]].min()


def test_context_mask_is_true_exactly_inside_each_context():
    g = SingleQueryGroup(token_index=torch.arange(3), context_blocks=torch.zeros(3, 2, dtype=torch.long),
                         context_lens=torch.tensor([1, 17, 32]), block_size=16)
    mask = g.context_mask
    assert mask.shape == (3, 1, 1, 32) and g.context_mask is mask  # made once, then shared by the layers
    assert mask[:, 0, 0].sum(dim=1).tolist() == [1, 17, 32] and not mask[0, 0, 0, 1:].any()
