"""What "computed in fp32, rounded once to bf16" means for a kernel's output, as tests check it."""

from __future__ import annotations

import torch


def assert_rounded_once_to_bf16(out: torch.Tensor, reference: torch.Tensor, atol: float = 1e-6) -> None:
    """`out` (bf16) is `reference` (computed in fp32 or fp64 from the same bf16 inputs) rounded to bf16.

    Round to nearest is off by at most half a bf16 ulp, up to 2^-8 of the value just above a power of
    two; one ulp (2^-7) leaves room for the kernel's fp32 error (exp's ~2 ulp, summation order) tipping
    a value across a rounding boundary. That alone would let truncation through, so nearly every element
    must also equal the reference's own bf16 rounding: the fp32 error is ~1e-6 of the value against a
    bf16 ulp of ~4e-3, so it flips a rounding in well under 1% of elements, where truncation or a
    second rounding of an intermediate would change a good part of them.
    """
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), reference.double(), atol=atol, rtol=2**-7, equal_nan=True)
    if out.numel():
        same = (out == reference.to(torch.bfloat16)) | (out.isnan() & reference.isnan())
        assert same.double().mean().item() >= 0.99, f"{(~same).sum().item()} of {out.numel()} differ"


def assert_as_close_as_torch(out: torch.Tensor, expected: torch.Tensor, torch_out: torch.Tensor) -> None:
    """bf16 `out` is no further from `expected` than torch's bf16 attention (`torch_out`), on average and at
    worst: the bar where a kernel multiplies p.V with p rounded to bf16, as torch's bf16 SDPA does."""
    err, torch_err = (out.double() - expected).abs(), (torch_out - expected).abs()
    assert err.mean() <= 1.1 * torch_err.mean(), (err.mean().item(), torch_err.mean().item())
    assert err.max() <= 1.5 * torch_err.max(), (err.max().item(), torch_err.max().item())
