"""PromQL's `histogram_quantile`, computed here on bucket counts taken from scrapes.

Same algorithm as Prometheus (promql/quantile.go, v2.42): buckets sorted by upper bound, made monotonic,
the rank found by binary search over all but the +Inf bucket, and linear interpolation inside the bucket
it falls in (from 0 for the first bucket); a rank in the +Inf bucket answers the highest finite bound.
So a p99 measured by scraping pods directly equals the one Prometheus would compute from the same deltas.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping


def histogram_quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """The q-quantile of a histogram given as {upper bound (le): cumulative count}; None when there is
    no observation, no +Inf bucket or fewer than two buckets (PromQL answers NaN there)."""
    if not 0 <= q <= 1:
        return -math.inf if q < 0 else math.inf
    bounds = sorted(buckets)
    if len(bounds) < 2 or bounds[-1] != math.inf:
        return None
    counts = [float(buckets[b]) for b in bounds]
    for i in range(1, len(counts)):  # Prometheus' ensureMonotonic: rates of buckets can cross by noise
        counts[i] = max(counts[i], counts[i - 1])
    total = counts[-1]
    if total == 0:
        return None
    rank = q * total
    b = bisect.bisect_left(counts, rank, 0, len(counts) - 1)  # first bucket with count >= rank (not +Inf)
    if b == len(bounds) - 1:
        return bounds[-2]
    if b == 0 and bounds[0] <= 0:
        return bounds[0]
    start, end, count = 0.0, bounds[b], counts[b]
    if b > 0:
        start = bounds[b - 1]
        count -= counts[b - 1]
        rank -= counts[b - 1]
    if count == 0:
        return None  # only for q = 0 over an empty first bucket; PromQL answers NaN
    return start + (end - start) * (rank / count)


def add_buckets(into: dict[float, float], more: Mapping[float, float]) -> None:
    """Sum bucket counts by upper bound: merging pods is `sum by (le)`."""
    for le, count in more.items():
        into[le] = into.get(le, 0.0) + count
