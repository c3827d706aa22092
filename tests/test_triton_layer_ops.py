"""The fused Triton layer ops (residual add + RMSNorm, rotary embedding, SwiGLU) against torch
references, run by the Triton interpreter on CPU in fp32 and fp16."""

from __future__ import annotations

import pytest
import torch

from iterserve.kernels.triton_layer_ops import add_rms_norm_triton, rotary_triton, silu_mul_triton
from iterserve.kernels.triton_reference import add_rms_norm_reference, rope_reference, silu_mul_reference
from tests.triton_support import TOLERANCE  # sets TRITON_INTERPRET first

DTYPES = [torch.float32, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("rows, hidden", [(3, 48), (1, 64), (0, 32)])  # 48: not a power of two
def test_add_rms_norm(dtype, with_residual, rows, hidden):
    gen = torch.Generator().manual_seed(rows + hidden)
    x = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype)
    residual = torch.randn(rows, hidden, generator=gen).to(dtype) if with_residual else None
    weight = torch.rand(hidden, generator=gen).to(dtype) + 0.5
    out, summed = add_rms_norm_triton(x, residual, weight, 1e-5)
    expected, expected_sum = add_rms_norm_reference(x, residual, weight, 1e-5)
    torch.testing.assert_close(summed, expected_sum, atol=0, rtol=0)  # the add rounds as torch's does
    torch.testing.assert_close(out.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads, head_dim", [(6, 16), (3, 24)])
def test_rotary_rotates_strided_heads_in_place(dtype, num_heads, head_dim):
    gen = torch.Generator().manual_seed(num_heads)
    num_tokens, max_pos = 5, 40
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.arange(max_pos).float()[:, None] * inv_freq[None, :]
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
    # q and k heads as a column slice of a wider fused projection (v's columns follow, untouched)
    qkv = torch.randn(num_tokens, (num_heads + 2) * head_dim, generator=gen).to(dtype)
    before = qkv.clone()
    qk = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    positions = torch.tensor([0, 17, 3, 39, 17])
    expected = rope_reference(qk.clone(), positions, cos, sin)
    assert rotary_triton(qk, positions, cos, sin) is qk
    torch.testing.assert_close(qk.float(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    assert torch.equal(qkv[:, num_heads * head_dim:], before[:, num_heads * head_dim:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, n", [(4, 40), (0, 8)])
def test_silu_mul(dtype, rows, n):
    gate_up = (torch.randn(rows, 2 * n, generator=torch.Generator().manual_seed(n)) * 4).to(dtype)
    out = silu_mul_triton(gate_up)
    assert out.shape == (rows, n) and out.dtype == dtype
    torch.testing.assert_close(out.float(), silu_mul_reference(gate_up), atol=TOLERANCE[dtype] * 4,
                               rtol=TOLERANCE[dtype])
