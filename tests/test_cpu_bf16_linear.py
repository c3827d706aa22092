"""The bf16 linear kernel (kernels/csrc/bf16_linear.cpp) against its torch reference: fp32 sums of the
bf16 products, rounded to bf16 once. Runs where the CPU has AVX512-BF16 (the project's Zen 5 machines);
skipped elsewhere, where PackedLinear keeps oneDNN."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from iterserve.kernels import cpu_bf16_linear

pytestmark = pytest.mark.skipif(not cpu_bf16_linear.available(), reason="no AVX512-BF16 kernel on this CPU")


def reference(x, weight, bias):
    y = x.float() @ weight.float().t()
    return (y if bias is None else y + bias.float()).bfloat16()


def check(rows, out_features, in_features, with_bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=g).bfloat16()
    x = torch.randn(rows, in_features, generator=g).bfloat16()
    bias = torch.randn(out_features, generator=g) if with_bias else None
    got = cpu_bf16_linear.linear(x, cpu_bf16_linear.pack(weight), out_features, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    # the same fp32 sums in another order: at most the last bf16 bit apart (2^-7 relative, plus the
    # cancellation a sum of K products of ~1 can show)
    torch.testing.assert_close(got.float(), reference(x, weight, bias).float(),
                               rtol=2 ** -7, atol=1e-4 * in_features ** 0.5)


# every few-rows case (1-8), the tiled path with each remainder (9-23), and a prefill's rows split into
# equal row blocks (257: two of 136 and 121; 1,001: four of 256 and 233); column counts off the 16-column
# block and off the tile's 48, and K from one pair up
@pytest.mark.parametrize("rows", [*range(1, 24), 64, 257, 301, 600, 1001])
def test_rows(rows):
    check(rows, out_features=100, in_features=64, with_bias=False, seed=rows)


@pytest.mark.parametrize("out_features", [1, 15, 16, 17, 47, 48, 96, 97, 960])
@pytest.mark.parametrize("rows", [1, 8, 13])
def test_columns_and_bias(rows, out_features):
    check(rows, out_features, in_features=576, with_bias=True, seed=out_features)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(0, 40), out_features=st.integers(1, 200), half_in=st.integers(1, 96), bias=st.booleans())
def test_any_shape(rows, out_features, half_in, bias):
    check(rows, out_features, 2 * half_in, bias)


def test_leading_dims_and_strided_rows():
    weight = torch.randn(48, 64).bfloat16()
    packed = cpu_bf16_linear.pack(weight)
    x = torch.randn(2, 3, 64).bfloat16()
    torch.testing.assert_close(cpu_bf16_linear.linear(x, packed, 48, None), reference(x.reshape(6, 64), weight, None)
                               .reshape(2, 3, 48), rtol=2 ** -7, atol=1e-3)
    wide = torch.randn(5, 128).bfloat16()
    torch.testing.assert_close(cpu_bf16_linear.linear(wide[:, :64], packed, 48, None),
                               reference(wide[:, :64], weight, None), rtol=2 ** -7, atol=1e-3)


def test_bad_inputs_are_refused():
    packed = cpu_bf16_linear.pack(torch.randn(16, 64).bfloat16())
    with pytest.raises(RuntimeError, match="does not fit"):
        cpu_bf16_linear.linear(torch.randn(2, 32).bfloat16(), packed, 16, None)
    with pytest.raises(RuntimeError, match="bias"):
        cpu_bf16_linear.linear(torch.randn(2, 64).bfloat16(), packed, 16, torch.randn(16).bfloat16())
    with pytest.raises(RuntimeError, match="even"):
        cpu_bf16_linear.pack(torch.randn(16, 63).bfloat16())
    assert not cpu_bf16_linear.packs(torch.randn(16, 63).bfloat16())


def test_packed_linear_takes_the_kernel_for_bf16(monkeypatch):
    from iterserve.server.model.cpu_linear import PackedLinear

    weight, bias = torch.randn(96, 576).bfloat16(), torch.randn(96).bfloat16()
    x = torch.randn(3, 576).bfloat16()
    packed = PackedLinear(weight, bias)
    assert packed.in_kernel
    torch.testing.assert_close(packed(x).float(), reference(x, weight, bias).float(), rtol=2 ** -7, atol=1e-2)
    monkeypatch.setenv(cpu_bf16_linear.ENV_VAR, "torch")  # the kill switch: oneDNN, read at packing
    assert not PackedLinear(weight, bias).in_kernel
    assert not PackedLinear(weight.float()).in_kernel
