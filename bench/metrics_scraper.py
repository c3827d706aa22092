"""The server's own view: `/metrics` (Prometheus text) scraped before, during and after a run.

Values are summed over label sets except `le`, so one server's `model_name`/`engine` labels drop
out; histogram buckets keep their edge (`name|le`). Counters and histograms are reported as the
difference between the scrape before and the scrape after the run (what this run caused); gauges
(KV usage, running, waiting, the live knobs) as series over time. A server without `/metrics`, or
with something else there, just has no server figures: the run goes on.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

KNOBS = ("max_num_seqs", "max_num_batched_tokens", "prefill_chunk_size")
SERIES = ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting",
          "vllm:num_preemptions_total") + tuple(f"iterserve:{k}" for k in KNOBS)
LATENCY_HISTOGRAMS = {"ttft": "vllm:time_to_first_token_seconds", "itl": "vllm:inter_token_latency_seconds",
                      "tpot": "vllm:request_time_per_output_token_seconds",
                      "e2e": "vllm:e2e_request_latency_seconds", "queue": "vllm:request_queue_time_seconds"}


@dataclass
class Scrape:
    t: float  # seconds since the run started (negative: before it)
    values: dict[str, float]
    info: dict[str, str] = field(default_factory=dict)  # labels of *_info metrics (server configuration)


def parse_metrics(text: str, t: float = 0.0) -> Scrape:
    values: dict[str, float] = {}
    info: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            if family.type == "info" or sample.name.endswith("_info"):
                for k, v in sample.labels.items():
                    if k not in ("model_name", "engine"):
                        info[f"{sample.name}.{k}"] = v
                continue
            key = f"{sample.name}|{sample.labels['le']}" if "le" in sample.labels else sample.name
            values[key] = values.get(key, 0.0) + sample.value
    return Scrape(t, values, info)


def histogram_buckets(values: dict[str, float], name: str) -> list[tuple[float, float]]:
    """[(upper edge, cumulative count)] in edge order, +Inf last."""
    prefix = f"{name}_bucket|"
    return sorted((float(k[len(prefix):]), v) for k, v in values.items() if k.startswith(prefix))


def histogram_delta(before: Scrape, after: Scrape, name: str) -> list[tuple[float, float]]:
    old = dict(histogram_buckets(before.values, name))
    return [(le, count - old.get(le, 0.0)) for le, count in histogram_buckets(after.values, name)]


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus' estimate: linear inside the bucket that holds the q-th observation."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_edge, lower_count = 0.0, 0.0
    for edge, count in buckets:
        if count >= rank:
            if math.isinf(edge):
                return lower_edge  # beyond the last finite edge: Prometheus answers that edge
            width = count - lower_count
            return lower_edge + (edge - lower_edge) * ((rank - lower_count) / width if width else 0.0)
        lower_edge, lower_count = edge, count
    return lower_edge


def summarize_scrapes(scrapes: list[Scrape]) -> dict | None:
    """Server-side figures of one run from its scrapes (first = before, last = after)."""
    if len(scrapes) < 2:
        return None
    before, after = scrapes[0], scrapes[-1]

    def delta(name: str) -> float | None:
        if name not in after.values:
            return None
        return after.values[name] - before.values.get(name, 0.0)

    histograms = {}
    for short, name in LATENCY_HISTOGRAMS.items():
        buckets = histogram_delta(before, after, name)
        if not buckets:
            continue
        count, total = delta(f"{name}_count") or 0.0, delta(f"{name}_sum") or 0.0
        histograms[short] = {
            "count": count, "mean_ms": 1000 * total / count if count else None,
            **{f"p{q}_ms": _ms(histogram_quantile(q / 100, buckets)) for q in (50, 90, 99)},
            "buckets": [[le if math.isfinite(le) else "+Inf", c] for le, c in buckets]}
    series = {name: [[round(s.t, 3), s.values[name]] for s in scrapes if name in s.values] for name in SERIES}
    kv = [v for _, v in series["vllm:kv_cache_usage_perc"]]
    return {
        "num_scrapes": len(scrapes),
        "preemptions": delta("vllm:num_preemptions_total"),
        "prompt_tokens": delta("vllm:prompt_tokens_total"),
        "generation_tokens": delta("vllm:generation_tokens_total"),
        "kv_cache_usage": {"max": max(kv), "mean": sum(kv) / len(kv)} if kv else None,
        "knobs_before": knob_values(before), "knobs_after": knob_values(after),
        "histograms": histograms,
        "series": {k: v for k, v in series.items() if v},
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000 * seconds


def knob_values(scrape: Scrape) -> dict[str, float]:
    return {k: scrape.values[f"iterserve:{k}"] for k in KNOBS if f"iterserve:{k}" in scrape.values}


class MetricsScraper:
    """Scrapes `url/metrics` on demand and every `interval` seconds while `run` is awaited."""

    def __init__(self, client: httpx.AsyncClient, url: str, t0: float, interval: float = 1.0):
        self.client, self.url, self.t0, self.interval = client, url, t0, interval
        self.scrapes: list[Scrape] = []
        self.available = True
        self.problem: str | None = None

    async def scrape(self) -> Scrape | None:
        if not self.available:
            return None
        try:
            r = await self.client.get(self.url + "/metrics", timeout=10)
            if r.status_code != 200:
                raise ValueError(f"HTTP {r.status_code}")
            scrape = parse_metrics(r.text, time.perf_counter() - self.t0)
        except (httpx.HTTPError, ValueError) as e:
            if not self.scrapes:  # never worked: this server has no Prometheus metrics
                self.available, self.problem = False, f"{self.url}/metrics: {type(e).__name__}: {e}"
            return None
        if not scrape.values:
            self.available, self.problem = False, f"{self.url}/metrics: no samples"
            return None
        self.scrapes.append(scrape)
        return scrape

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), self.interval)
            except asyncio.TimeoutError:
                await self.scrape()
