"""The C++ CPU decode-attention kernel against a per-request float64 torch computation and against the
torch path's gather + SDPA, and the ITERSERVE_CPU_ATTENTION kill switch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from iterserve.kernels import cpu_paged_attention
from iterserve.kernels.attention_metadata import AttentionMetadata, SingleQueryGroup
from iterserve.kernels.paged_attention_torch import paged_attention
from iterserve.server.runner.step_inputs import _groups_by_context


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
                 seed: int = 0):
    """Caches with more blocks than the requests use, handed out in shuffled order, so block tables are
    neither contiguous nor increasing; tables padded with block 0."""
    gen = torch.Generator().manual_seed(seed)
    per_req = [-(-n // block_size) for n in lens]
    num_blocks = sum(per_req) + 5
    ids = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(lens), max(per_req), dtype=torch.long)
    taken = 0
    for r, nb in enumerate(per_req):
        tables[r, :nb] = ids[taken : taken + nb]
        taken += nb
    shape = (num_blocks * block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen)
    v_cache = torch.randn(shape, generator=gen)
    q = torch.randn(len(lens), num_kv_heads * group, head_dim, generator=gen)
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


@pytest.mark.parametrize("n", [1, 15, 16, 17, 300])
def test_kernel_single_request(kernel, n):
    q, k_cache, v_cache, tables, ctx = _random_case([n], 16, 3, 3, 64, seed=n)
    out = cpu_paged_attention.paged_decode_attention(q, k_cache, v_cache, tables, ctx, 16, 0.125)
    torch.testing.assert_close(out.double(), _reference(q, k_cache, v_cache, tables, ctx, 16, 0.125),
                               atol=1e-5, rtol=1e-5)


def _decode_step(lens: list[int], block_size: int, num_kv_heads: int, group: int, head_dim: int):
    """A step of decodes in two single-query groups (as step_inputs builds them), the new tokens' K/V
    still to be written by paged_attention."""
    q, k_cache, v_cache, tables, ctx = _random_case(lens, block_size, num_kv_heads, group, head_dim)
    last = ctx - 1
    slots = tables[torch.arange(len(lens)), last // block_size] * block_size + last % block_size
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(len(lens), num_kv_heads, head_dim, generator=gen)
    v = torch.randn(len(lens), num_kv_heads, head_dim, generator=gen)
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
