"""The Triton KV-write, paged decode and varlen prefill kernels against their torch references,
run by the Triton interpreter on CPU (fp32 and fp16; the interpreter computes bf16 wrongly)."""

from __future__ import annotations

import pytest
import torch

from iterserve.kernels.triton_decode_attention import MAX_SPLITS, choose_num_splits, decode_attention_triton
from iterserve.kernels.triton_kv_write import write_kv_triton
from iterserve.kernels.triton_prefill_attention import prefill_attention_triton
from iterserve.kernels.triton_reference import (
    decode_attention_reference,
    prefill_attention_reference,
    write_kv_reference,
)
from tests.triton_support import TOLERANCE, make_block_tables, make_cache  # sets TRITON_INTERPRET first

DTYPES = [torch.float32, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_write_scatters_rows_and_skips_negative_slots(dtype):
    gen = torch.Generator().manual_seed(0)
    num_kv_heads, head_dim, num_tokens = 2, 24, 5  # a row of 48: not a power of two
    # k and v as strided column slices of one fused projection, as the model hands them over
    qkv = torch.randn(num_tokens, (4 + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype)
    k = qkv[:, 4 * head_dim:6 * head_dim].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, 6 * head_dim:].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.tensor([13, 2, -1, 7, 0])  # scattered, with a padded row
    k_cache, v_cache = make_cache(4, 4, num_kv_heads, head_dim, dtype, gen)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    write_kv_reference(k, v, expected_k, expected_v, slots)
    write_kv_triton(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    write_kv_triton(k[:0], v[:0], k_cache, v_cache, slots[:0])  # an empty step writes nothing
    assert torch.equal(k_cache, expected_k)


# (block_size, num_heads, num_kv_heads, head_dim, context_lens, num_splits)
DECODE_CASES = [
    (4, 4, 4, 16, [1, 9, 23], 1),         # MHA; tiles of 16 span four blocks; contexts end mid-block
    (16, 8, 2, 32, [16, 33, 5], 1),       # GQA 4; a context of exactly one block
    (32, 8, 1, 16, [40, 1], 3),           # GQA 8 (MQA); a tile is half a block; uneven splits
    (8, 4, 2, 16, [0, 17, 50], 4),        # an empty context (a CUDA-graph padding row) gives zeros
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size, num_heads, num_kv_heads, head_dim, context_lens, num_splits", DECODE_CASES)
def test_decode_attention_matches_reference(dtype, block_size, num_heads, num_kv_heads, head_dim, context_lens,
                                            num_splits):
    gen = torch.Generator().manual_seed(len(context_lens) * 100 + block_size)
    num_seqs = len(context_lens)
    num_blocks = sum(-(-n // block_size) for n in context_lens) + 3
    k_cache, v_cache = make_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, gen)
    tables = make_block_tables(context_lens, block_size, num_blocks, gen)
    # the queries sit at scattered rows of a larger step (other rows belong to prefill chunks)
    q = torch.randn(num_seqs + 3, num_heads, head_dim, generator=gen).to(dtype)
    token_index = torch.randperm(num_seqs + 3, generator=gen)[:num_seqs]
    context = torch.tensor(context_lens, dtype=torch.int32)
    scale = head_dim ** -0.5
    out = torch.full_like(q, 7.0)
    decode_attention_triton(q, k_cache, v_cache, out, token_index, tables, context, block_size, scale,
                            num_splits=num_splits)
    expected = decode_attention_reference(q, k_cache, v_cache, token_index, tables, context, block_size, scale)
    torch.testing.assert_close(out[token_index].float(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    untouched = torch.ones(num_seqs + 3, dtype=torch.bool)
    untouched[token_index] = False
    assert (out[untouched] == 7.0).all(), "rows of other requests must be left alone"


def test_decode_split_and_unsplit_agree():
    gen = torch.Generator().manual_seed(5)
    k_cache, v_cache = make_cache(12, 8, 2, 16, torch.float32, gen)
    context = torch.tensor([70, 3], dtype=torch.int32)
    tables = make_block_tables(context.tolist(), 8, 12, gen)
    q = torch.randn(2, 4, 16, generator=gen)
    index = torch.arange(2)
    outs = []
    for splits in (1, 5):
        out = torch.empty_like(q)
        decode_attention_triton(q, k_cache, v_cache, out, index, tables, context, 8, 0.25, num_splits=splits)
        outs.append(out)
    torch.testing.assert_close(outs[0], outs[1], atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("num_seqs, num_kv_heads, max_context, num_sms, expected", [
    (1, 8, 32768, 132, MAX_SPLITS),   # batch 1 at a long context: as many splits as allowed
    (1, 8, 512, 132, 2),              # short context: at least 256 tokens per split
    (64, 8, 4096, 132, 2),            # 512 programs: about 4 per SM want one more split
    (256, 8, 4096, 132, 1),           # the batch alone fills the GPU
    (4, 8, 100, 132, 1),
])
def test_choose_num_splits(num_seqs, num_kv_heads, max_context, num_sms, expected):
    assert choose_num_splits(num_seqs, num_kv_heads, max_context, num_sms) == expected


# (block_size, num_heads, num_kv_heads, head_dim, [(tokens already cached, chunk length), ...])
PREFILL_CASES = [
    (4, 4, 2, 16, [(0, 20), (9, 7), (0, 1)]),     # fresh prefill; an odd chunk after context; one token
    (16, 8, 2, 32, [(33, 13), (0, 17)]),          # chunk ending mid-block after 2 blocks of context
    (8, 4, 1, 16, [(5, 1), (0, 0), (3, 18)]),     # a single-token chunk; an empty chunk; MQA
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size, num_heads, num_kv_heads, head_dim, chunks", PREFILL_CASES)
def test_prefill_attention_matches_reference(dtype, block_size, num_heads, num_kv_heads, head_dim, chunks):
    gen = torch.Generator().manual_seed(len(chunks) * 10 + block_size)
    context_lens = [past + n for past, n in chunks]
    query_lens = torch.tensor([n for _, n in chunks], dtype=torch.int32)
    query_start = torch.cumsum(query_lens, 0, dtype=torch.int32) - query_lens + 2  # two rows before: decodes
    num_rows = int(query_start[-1] + query_lens[-1]) + 1
    num_blocks = sum(-(-n // block_size) for n in context_lens) + 2
    k_cache, v_cache = make_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, gen)
    tables = make_block_tables(context_lens, block_size, num_blocks, gen)
    q = torch.randn(num_rows, num_heads, head_dim, generator=gen).to(dtype)
    context = torch.tensor(context_lens, dtype=torch.int32)
    scale = head_dim ** -0.5
    out = torch.full_like(q, 7.0)
    prefill_attention_triton(q, k_cache, v_cache, out, query_start, query_lens, context, tables,
                             int(query_lens.max()), block_size, scale)
    expected = prefill_attention_reference(q, k_cache, v_cache, query_start, query_lens, context, tables,
                                           block_size, scale)
    rows = sorted(expected)
    torch.testing.assert_close(out[rows].float(), torch.stack([expected[r] for r in rows]),
                               atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    others = [r for r in range(num_rows) if r not in expected]
    assert (out[others] == 7.0).all(), "rows outside the chunks must be left alone"


def test_prefill_of_nothing_is_a_no_op():
    q = torch.randn(3, 4, 16)
    out = q.clone()
    cache = torch.zeros(16, 2, 16)
    empty = torch.zeros(0, dtype=torch.int32)
    prefill_attention_triton(q, cache, cache, out, empty, empty, empty, torch.zeros(0, 1, dtype=torch.int32),
                             0, 8, 0.25)
    assert torch.equal(out, q)
