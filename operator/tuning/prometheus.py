"""Observations from Prometheus' HTTP API (`/api/v1/query`) instead of scraping pods.

The same Observation as the direct scraper, in PromQL: p99s are `histogram_quantile(0.99, sum by (le)
(rate(<histogram>_bucket{sel}[w])))`, rates `sum(rate(...))`, gauges `avg_over_time`. `sel` picks the
service's pods: a label matcher given in the configuration (e.g. `service="chat"`, or
`namespace="team-a",pod=~"chat-.*"` under Kubernetes pod discovery), else the pods' `instance` labels,
which Prometheus sets to each scraped target's host:port.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from urllib.parse import urlsplit

import httpx

from iterserve.operator.tuning.observation import (
    GENERATION_TOKENS,
    HTTP_RESPONSES,
    INFERENCE_TIME,
    ITL,
    KV_USAGE,
    PREEMPTIONS,
    PROMPT_TOKENS,
    QUEUE_TIME,
    REQUESTS,
    RUNNING,
    STEP_FAILURES,
    TTFT,
    WAITING,
    Observation,
)


class PrometheusError(Exception):
    pass


def instance_selector(pod_urls: Sequence[str]) -> str:
    """`instance=~"10.0.0.7:8000|10.0.0.8:8000"` for pods reached at http://10.0.0.7:8000, ..."""
    instances = sorted({urlsplit(u).netloc for u in pod_urls})
    return 'instance=~"' + "|".join(re.escape(i).replace("\\", "\\\\") for i in instances) + '"'


def promql_queries(sel: str, window: str) -> dict[str, str]:
    """Each Observation field's PromQL over the pods matched by `sel`, on a range of `window`."""

    def p99(hist: str) -> str:
        return f"histogram_quantile(0.99, sum by (le) (rate({hist}_bucket{{{sel}}}[{window}])))"

    def rate(counter: str) -> str:
        return f"sum(rate({counter}{{{sel}}}[{window}]))"

    return {
        "ttft_p99_s": p99(TTFT),
        "itl_p99_s": p99(ITL),
        "num_samples": f"sum(increase({TTFT}_count{{{sel}}}[{window}]))",
        "request_rate": rate(REQUESTS),
        "prompt_token_rate": rate(PROMPT_TOKENS),
        "generation_token_rate": rate(GENERATION_TOKENS),
        "preemption_rate": rate(PREEMPTIONS),
        # `or vector(0)`: a server that never failed has no 5xx series, and an empty side would empty the sum
        "error_rate": f"({rate(STEP_FAILURES)} or vector(0)) + "
                      f"(sum(rate({HTTP_RESPONSES}{{{sel},code=~\"5..\"}}[{window}])) or vector(0))",
        "queue_time_mean_s": f"sum(rate({QUEUE_TIME}_sum{{{sel}}}[{window}])) / "
                             f"sum(rate({QUEUE_TIME}_count{{{sel}}}[{window}]))",
        "inference_time_mean_s": f"sum(rate({INFERENCE_TIME}_sum{{{sel}}}[{window}])) / "
                                 f"sum(rate({INFERENCE_TIME}_count{{{sel}}}[{window}]))",
        "waiting": f"sum(avg_over_time({WAITING}{{{sel}}}[{window}]))",
        "running": f"sum(avg_over_time({RUNNING}{{{sel}}}[{window}]))",
        "kv_usage": f"max(avg_over_time({KV_USAGE}{{{sel}}}[{window}]))",
        "num_pods": f"count(max by (instance) (max_over_time({KV_USAGE}{{{sel}}}[{window}])))",
    }


class PrometheusSource:
    """A MetricsSource over a Prometheus server; it keeps no history (Prometheus does)."""

    def __init__(self, url: str, selector: str | None = None, timeout: float = 5.0):
        self.url = url.rstrip("/")
        self.selector = selector
        self.timeout = timeout

    def snapshot(self, pod_urls: Sequence[str], now: float) -> None:
        return None

    def observe(self, pod_urls: Sequence[str], now: float, window_s: float,
                since: float | None = None) -> Observation | None:
        if not pod_urls and self.selector is None:
            return None
        span = window_s if since is None else min(window_s, now - since)
        if span <= 0:
            return Observation.empty(now)
        sel = self.selector if self.selector is not None else instance_selector(pod_urls)
        values: dict[str, float | None] = {}
        try:
            for name, query in promql_queries(sel, f"{max(1, int(span * 1000))}ms").items():
                values[name] = self.query_scalar(query)
        except PrometheusError as e:
            return Observation.empty(now, (str(e),))
        zero = lambda name: values[name] or 0.0  # noqa: E731 (an empty vector: nothing happened)
        return Observation(
            start=now - span, end=now, num_pods=round(zero("num_pods")), num_samples=round(zero("num_samples")),
            ttft_p99_s=values["ttft_p99_s"], itl_p99_s=values["itl_p99_s"], request_rate=zero("request_rate"),
            prompt_token_rate=zero("prompt_token_rate"), generation_token_rate=zero("generation_token_rate"),
            waiting=zero("waiting"), running=zero("running"), queue_time_mean_s=values["queue_time_mean_s"],
            kv_usage=zero("kv_usage"), preemption_rate=zero("preemption_rate"), error_rate=zero("error_rate"),
            inference_time_mean_s=values["inference_time_mean_s"])

    def query_scalar(self, query: str) -> float | None:
        """The single value of an instant query; None for an empty vector or NaN."""
        try:
            r = httpx.get(f"{self.url}/api/v1/query", params={"query": query}, timeout=self.timeout)
            body = r.json()
        except (httpx.HTTPError, ValueError) as e:
            raise PrometheusError(f"{self.url}: {type(e).__name__}: {e}") from e
        if body.get("status") != "success":
            raise PrometheusError(f"{self.url}: {body.get('errorType')}: {body.get('error')} (query: {query})")
        result = body["data"]["result"]
        if not result:
            return None
        if len(result) > 1:
            raise PrometheusError(f"{self.url}: {len(result)} series where one was expected (query: {query})")
        value = float(result[0]["value"][1])
        return None if math.isnan(value) or math.isinf(value) else value
