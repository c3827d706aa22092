"""Figures of one run, computed from its per-request records only (pure; the tests recompute them).

- TTFT: request sent -> first chunk carrying a token. E2E: sent -> end of stream.
- ITL: gaps between consecutive token-carrying chunks, pooled over all requests (as vLLM's
  benchmark_serving does); a chunk that carries k tokens is one gap.
- TPOT, per request: (E2E - TTFT) / (output tokens - 1), for requests with at least two tokens.
- Percentiles interpolate linearly between closest ranks (numpy's default).
- Duration: first request sent -> last request ended. Throughputs divide by it.
- Goodput: requests per second that succeeded and met every SLO given (`ttft`, `tpot`, `e2e`, and
  `itl`, which a request meets when its slowest inter-token gap is within it), in milliseconds.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from iterserve.bench.client import RequestRecord

QUANTILES = (50, 90, 99)
SLO_KEYS = ("ttft", "tpot", "itl", "e2e")


def ttft(r: RequestRecord) -> float | None:
    return None if r.first_token is None else r.first_token - r.start


def e2e(r: RequestRecord) -> float | None:
    return None if r.end is None else r.end - r.start


def itls(r: RequestRecord) -> list[float]:
    return [b - a for a, b in zip(r.chunk_times, r.chunk_times[1:], strict=False)]


def tpot(r: RequestRecord) -> float | None:
    if r.first_token is None or r.end is None or r.output_tokens < 2:
        return None
    return (r.end - r.first_token) / (r.output_tokens - 1)


def stats_ms(seconds: list[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99, max in milliseconds (None for an empty list)."""
    if not seconds:
        return {"mean": None, **{f"p{q}": None for q in QUANTILES}, "max": None, "count": 0}
    ms = np.asarray(seconds, dtype=float) * 1000.0
    return {"mean": float(ms.mean()), **{f"p{q}": float(np.percentile(ms, q)) for q in QUANTILES},
            "max": float(ms.max()), "count": int(ms.size)}


def parse_slo(text: str) -> dict[str, float]:
    """`ttft=500,itl=100` -> {"ttft": 500.0, "itl": 100.0} (milliseconds)."""
    slo = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        try:
            ms = float(value)
        except ValueError:
            ms = -1.0
        if not sep or key not in SLO_KEYS or not ms > 0:
            raise ValueError(f"--slo: cannot read {part!r}; write e.g. ttft=500,itl=100 (milliseconds; "
                             f"keys {', '.join(SLO_KEYS)})")
        slo[key] = ms
    return slo


def meets_slo(r: RequestRecord, slo: dict[str, float]) -> dict[str, bool]:
    """Per SLO key: did this (successful) request meet it."""
    measured = {"ttft": ttft(r), "tpot": tpot(r), "e2e": e2e(r), "itl": max(itls(r), default=0.0)}
    return {k: (v := measured[k]) is not None and v * 1000.0 <= limit for k, limit in slo.items()}


def goodput(records: list[RequestRecord], slo: dict[str, float], duration: float) -> dict | None:
    if not slo:
        return None
    ok = [r for r in records if r.ok]
    verdicts = [meets_slo(r, slo) for r in ok]
    good = sum(all(v.values()) for v in verdicts)
    return {"slo_ms": dict(slo), "num_good": good,
            "request_rate": good / duration if duration > 0 else 0.0,
            "fraction_of_requests": good / len(records) if records else 0.0,
            "attainment": {k: (sum(v[k] for v in verdicts) / len(ok) if ok else 0.0) for k in slo}}


def duration_of(records: list[RequestRecord]) -> float:
    if not records:
        return 0.0
    ends = [r.end for r in records if r.end is not None] or [r.start for r in records]
    return max(ends) - min(r.start for r in records)


def summarize(records: list[RequestRecord], slo: dict[str, float] | None = None) -> dict:
    """Every client-side figure of one run."""
    ok = [r for r in records if r.ok]
    num = len(records)
    duration = duration_of(records)
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens if r.prompt_tokens is not None else (r.input_len or 0) for r in ok)
    kinds = Counter(r.error_kind for r in records if r.error_kind)
    errors = Counter(r.error for r in records if r.error)

    def per_second(x: float) -> float:
        return x / duration if duration > 0 else 0.0

    return {
        "num_requests": num,
        "num_completed": len(ok),
        "num_failed": num - len(ok),
        "num_errors_by_kind": dict(kinds),
        "error_rate": (num - len(ok) - kinds.get("cancelled", 0) - kinds.get("timeout", 0)) / num if num else 0.0,
        "timeout_rate": kinds.get("timeout", 0) / num if num else 0.0,
        "top_errors": [[message, count] for message, count in errors.most_common(5)],
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": per_second(len(ok)),
        "output_throughput": per_second(out_tokens),
        "total_token_throughput": per_second(in_tokens + out_tokens),
        "ttft_ms": stats_ms([t for r in ok if (t := ttft(r)) is not None]),
        "tpot_ms": stats_ms([t for r in ok if (t := tpot(r)) is not None]),
        "itl_ms": stats_ms([g for r in ok for g in itls(r)]),
        "e2e_ms": stats_ms([t for r in ok if (t := e2e(r)) is not None]),
        "goodput": goodput(records, slo or {}, duration),
    }


def fraction_at_or_below(values: list[float], edges: list[float]) -> list[float]:
    """For each edge, the share of values <= it (a histogram's normalized cumulative counts)."""
    if not values:
        return [0.0 for _ in edges]
    arr = np.sort(np.asarray(values, dtype=float))
    return [float(np.searchsorted(arr, e, side="right")) / arr.size for e in edges]
