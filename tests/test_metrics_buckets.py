"""The latency histograms' buckets: vLLM's edges, plus enough between them that a p99 read off a window
of few samples is not a whole coarse bucket away from the SLO it is judged against."""

from __future__ import annotations

import math

import pytest

from iterserve.operator.tuning.histograms import histogram_quantile
from iterserve.server.api.metrics import PER_TOKEN_BUCKETS, TTFT_BUCKETS, VLLM_PER_TOKEN_BUCKETS, VLLM_TTFT_BUCKETS


def cumulative(edges: list[float], seconds: list[float]) -> dict[float, float]:
    """What a Prometheus histogram with these edges exports after observing `seconds`."""
    return {le: float(sum(s <= le for s in seconds)) for le in [*edges, math.inf]}


@pytest.mark.parametrize("ours, vllm, low, high", [
    (TTFT_BUCKETS, VLLM_TTFT_BUCKETS, 0.1, 10.0),
    (PER_TOKEN_BUCKETS, VLLM_PER_TOKEN_BUCKETS, 0.05, 2.5),
])
def test_every_vllm_edge_stays_and_no_bucket_in_the_slo_range_spans_more_than_one_and_a_half(ours, vllm, low, high):
    assert ours == sorted(set(ours))
    assert set(vllm) <= set(ours)
    widths = [b / a for a, b in zip(ours, ours[1:], strict=False) if low <= a < high]
    assert max(widths) <= 1.5 + 1e-9, widths


def test_one_slow_first_token_among_few_is_not_read_as_a_breach_of_a_slo_it_met():
    # six first tokens in a window, the slowest at 2.6 s: under a 4 s SLO
    window = [0.3, 0.5, 0.7, 0.9, 1.1, 2.6]
    assert histogram_quantile(0.99, cumulative(VLLM_TTFT_BUCKETS, window)) > 4.0  # 2.5-5 s bucket: a false breach
    assert histogram_quantile(0.99, cumulative(TTFT_BUCKETS, window)) <= 3.0
