"""The greedy sampler's C++ argmax (`cpu_layer_ops.first_max`) answers as torch's max(dim=-1).indices:
the first of equal maxima (-0 equal to +0), a NaN above everything, in float32 and bfloat16, over rows
that end inside, at and past its 2,048-value chunks, with any row stride."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from iterserve.kernels import cpu_layer_ops
from iterserve.server.runner.sampler import greedy_output
from tests.test_cpu_layer_ops import kernel  # noqa: F401  (a fixture)
from tests.test_greedy_argmax import row

# few distinct values, so that ties are frequent; the specials each rank differently
VALUES = [-float("inf"), -3.0, -0.0, 0.0, 1.25, 7.0, float("inf"), float("nan")]
CHUNK = 2048


@st.composite
def logits(draw):
    rows = draw(st.integers(1, 5))
    n = draw(st.sampled_from([1, 7, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5]))
    alphabet = draw(st.lists(st.sampled_from(VALUES), min_size=1, max_size=4, unique_by=str))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    picks = torch.randint(len(alphabet), (rows, n), generator=g)
    x = torch.tensor(alphabet)[picks]
    # a rare maximum planted somewhere, so that the winner is not always in the first chunk
    if draw(st.booleans()):
        r, c = draw(st.integers(0, rows - 1)), draw(st.integers(0, n - 1))
        x[r, c] = draw(st.sampled_from([8.0, float("inf"), float("nan")]))
    return x


# the fixture only checks that the kernels load: nothing in it needs resetting between examples
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(logits(), st.sampled_from([torch.float32, torch.bfloat16]), st.booleans())
def test_first_max_is_torchs_first_maximum(kernel, x, dtype, strided):  # noqa: F811
    x = x.to(dtype)
    if strided:  # rows of a wider tensor, as the rows sampled out of a bigger batch can be
        x = torch.cat([x, torch.zeros_like(x[:, :3])], dim=1)[:, : x.shape[1]]
    got = cpu_layer_ops.first_max(x)
    assert got.dtype == torch.int64
    assert torch.equal(got, x.max(dim=-1).indices)


def test_the_greedy_sampler_takes_its_tokens_from_the_kernel(kernel, monkeypatch):  # noqa: F811
    calls = []
    real = cpu_layer_ops._extension.loaded().first_max

    class Spy:
        def first_max(self, t):
            calls.append(t.shape)
            return real(t)

    monkeypatch.setattr(cpu_layer_ops._extension, "module", Spy())
    x = torch.randn(3, 5000).to(torch.bfloat16)
    out = greedy_output(x, [row(f"r{i}", temperature=0) for i in range(3)])
    assert calls == [torch.Size([3, 5000])]
    assert list(out.token_ids.values()) == x.max(dim=-1).indices.tolist()


@pytest.mark.parametrize("x", [torch.randn(2, 5, dtype=torch.float16), torch.randn(4, 6)[:, ::2],
                               torch.randn(7)])
def test_what_the_kernel_does_not_serve_takes_torchs_max(kernel, x):  # noqa: F811
    assert torch.equal(cpu_layer_ops.first_max(x), x.max(dim=-1).indices)


def test_first_max_without_the_kernel_is_torchs(monkeypatch):
    monkeypatch.setenv(cpu_layer_ops.ENV_VAR, "torch")
    x = torch.tensor([[1.0, 3.0, 3.0], [float("nan"), 2.0, float("nan")]])
    assert cpu_layer_ops.first_max(x).tolist() == [1, 0]
