"""Observations from pods' own /metrics, scraped by the tuner itself (no Prometheus needed).

Each `observe` scrapes every ready pod and keeps the scrapes; a window is the deltas between the scrape
nearest its start and the latest one. Counters and histogram buckets are summed over pods (PromQL's
`sum by (le)`), p99s come from `histogram_quantile` on the summed bucket deltas, gauges are averaged over
the window's scrapes. A pod whose counters went down between two scrapes restarted: from that pair on its
counters count from zero (what PromQL's `increase` assumes, but decided once per scrape for all series of
the pod, so a bucket that happens to be higher after the restart is not mistaken for growth).
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from iterserve.operator.tuning.histograms import add_buckets, histogram_quantile
from iterserve.operator.tuning.observation import (
    COUNTERS,
    GAUGES,
    GENERATION_TOKENS,
    HISTOGRAMS,
    HTTP_RESPONSES,
    INFERENCE_TIME,
    ITL,
    KV_USAGE,
    PREEMPTIONS,
    PROMPT_TOKENS,
    QUEUE_TIME,
    REQUESTS,
    RUNNING,
    SERVER_ERRORS,
    STEP_FAILURES,
    TTFT,
    WAITING,
    Observation,
)
from iterserve.operator.tuning.pod_http import pod_client

MAX_SCRAPES_PER_POD = 256


@dataclass
class PodScrape:
    """One pod's /metrics at time `t`: the series the tuner reads, summed over their label sets."""

    t: float
    counters: dict[str, float] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)
    buckets: dict[str, dict[float, float]] = field(default_factory=dict)  # histogram -> le -> cumulative
    sums: dict[str, float] = field(default_factory=dict)  # histogram -> sum of observations

    def went_down_since(self, prev: PodScrape) -> bool:
        """A restart: some cumulative value is lower than (or missing from) what `prev` read."""
        pairs: list[tuple[dict, dict]] = [(self.counters, prev.counters), (self.sums, prev.sums)]
        pairs += [(self.buckets.get(name, {}), b) for name, b in prev.buckets.items()]
        return any(current.get(key, -1.0) < before for current, earlier in pairs for key, before in earlier.items())


def parse_scrape(text: str, t: float) -> PodScrape:
    scrape = PodScrape(t)
    wanted_counters, wanted_gauges = set(COUNTERS), set(GAUGES)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name = s.name
            if name == HTTP_RESPONSES and s.labels.get("code", "").startswith("5"):
                name = SERVER_ERRORS
            if name in wanted_counters:
                scrape.counters[name] = scrape.counters.get(name, 0.0) + s.value
            elif name in wanted_gauges:
                scrape.gauges[name] = scrape.gauges.get(name, 0.0) + s.value
            elif name.endswith("_bucket") and name[:-7] in HISTOGRAMS:
                b = scrape.buckets.setdefault(name[:-7], {})
                le = float(s.labels["le"])
                b[le] = b.get(le, 0.0) + s.value
            elif name.endswith("_sum") and name[:-4] in HISTOGRAMS:
                scrape.sums[name[:-4]] = scrape.sums.get(name[:-4], 0.0) + s.value
    return scrape


@dataclass
class _Deltas:
    """What one pod's counters and buckets grew by over a window."""

    elapsed: float = 0.0
    counters: dict[str, float] = field(default_factory=dict)
    buckets: dict[str, dict[float, float]] = field(default_factory=dict)
    sums: dict[str, float] = field(default_factory=dict)


def pod_deltas(scrapes: Sequence[PodScrape]) -> _Deltas:
    out = _Deltas(elapsed=scrapes[-1].t - scrapes[0].t if scrapes else 0.0)
    for prev, cur in zip(scrapes, scrapes[1:], strict=False):
        base = PodScrape(prev.t) if cur.went_down_since(prev) else prev
        for name, value in cur.counters.items():
            out.counters[name] = out.counters.get(name, 0.0) + value - base.counters.get(name, 0.0)
        for name, value in cur.sums.items():
            out.sums[name] = out.sums.get(name, 0.0) + value - base.sums.get(name, 0.0)
        for name, b in cur.buckets.items():
            before = base.buckets.get(name, {})
            add_buckets(out.buckets.setdefault(name, {}), {le: c - before.get(le, 0.0) for le, c in b.items()})
    return out


def window_scrapes(history: Sequence[PodScrape], now: float, window_s: float,
                   since: float | None) -> list[PodScrape]:
    """The scrape nearest the window's start and every later one, none taken at or before `since`."""
    usable = [s for s in history if s.t <= now and (since is None or s.t > since)]
    if not usable:
        return []
    start = now - window_s
    first = min(range(len(usable)), key=lambda i: (abs(usable[i].t - start), -i))
    return usable[first:]


def observation_from_scrapes(per_pod: dict[str, list[PodScrape]], now: float,
                             errors: Sequence[str] = ()) -> Observation | None:
    """Merge the pods' windows into one Observation; None when no pod was listed, an empty one (no
    samples, the errors) when none could be read."""
    if not per_pod and not errors:
        return None
    per_pod = {url: s for url, s in per_pod.items() if s}
    if not per_pod:
        return Observation.empty(now, errors)
    rates = dict.fromkeys(COUNTERS, 0.0)
    merged: dict[str, dict[float, float]] = {name: {} for name in HISTOGRAMS}
    queue_sum = inference_sum = 0.0
    waiting = running = kv = 0.0
    for scrapes in per_pod.values():
        d = pod_deltas(scrapes)
        if d.elapsed > 0:
            for name in COUNTERS:
                rates[name] += d.counters.get(name, 0.0) / d.elapsed
        for name in HISTOGRAMS:
            add_buckets(merged[name], d.buckets.get(name, {}))
        queue_sum += d.sums.get(QUEUE_TIME, 0.0)
        inference_sum += d.sums.get(INFERENCE_TIME, 0.0)
        waiting += _mean(s.gauges.get(WAITING, 0.0) for s in scrapes)
        running += _mean(s.gauges.get(RUNNING, 0.0) for s in scrapes)
        kv = max(kv, _mean(s.gauges.get(KV_USAGE, 0.0) for s in scrapes))
    queue_count = merged[QUEUE_TIME].get(math.inf, 0.0)
    inference_count = merged[INFERENCE_TIME].get(math.inf, 0.0)
    return Observation(
        start=min(s[0].t for s in per_pod.values()), end=max(s[-1].t for s in per_pod.values()),
        num_pods=len(per_pod), num_samples=round(merged[TTFT].get(math.inf, 0.0)),
        ttft_p99_s=histogram_quantile(0.99, merged[TTFT]), itl_p99_s=histogram_quantile(0.99, merged[ITL]),
        request_rate=rates[REQUESTS], prompt_token_rate=rates[PROMPT_TOKENS],
        generation_token_rate=rates[GENERATION_TOKENS], waiting=waiting, running=running,
        queue_time_mean_s=queue_sum / queue_count if queue_count else None, kv_usage=kv,
        preemption_rate=rates[PREEMPTIONS], error_rate=rates[STEP_FAILURES] + rates[SERVER_ERRORS],
        errors=tuple(errors), inference_time_mean_s=inference_sum / inference_count if inference_count else None)


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


class PodScraper:
    """A MetricsSource that reads each pod's /metrics itself and keeps a short history per pod.

    `limit`, shared by every service's PodScraper in one operator, bounds the scrapes in flight across
    the whole fleet: each service's ticks run in their own thread, so without it 200 services ticking
    together would open up to `max_workers` connections each."""

    def __init__(self, timeout: float = 5.0, max_workers: int = 16, limit: threading.Semaphore | None = None):
        self.timeout = timeout
        self.max_workers = max_workers
        self.limit = limit
        self.history: dict[str, deque[PodScrape]] = {}

    def snapshot(self, pod_urls: Sequence[str], now: float) -> list[str]:
        """Scrape every pod once at `now`; returns the errors of the pods that could not be read."""
        for url in list(self.history):
            if url not in pod_urls:
                del self.history[url]  # a pod gone (or replaced under a new address) takes its history along
        errors: list[str] = []
        if not pod_urls:
            return errors
        with ThreadPoolExecutor(min(self.max_workers, len(pod_urls))) as pool:
            results = list(pool.map(self._scrape, pod_urls))
        for url, (text, error) in zip(pod_urls, results, strict=True):
            if error is not None:
                errors.append(f"{url}/metrics: {error}")
            else:
                assert text is not None  # a scrape without an error has its text
                self.history.setdefault(url, deque(maxlen=MAX_SCRAPES_PER_POD)).append(parse_scrape(text, now))
        return errors

    def observe(self, pod_urls: Sequence[str], now: float, window_s: float,
                since: float | None = None) -> Observation | None:
        errors = self.snapshot(pod_urls, now)
        for scrapes in self.history.values():
            while len(scrapes) > 2 and scrapes[1].t < now - 2 * window_s:
                scrapes.popleft()
        per_pod = {url: window_scrapes(self.history.get(url, ()), now, window_s, since) for url in pod_urls}
        return observation_from_scrapes(per_pod, now, errors)

    def waiting_now(self, pod_urls: Sequence[str], at: float) -> dict[str, float]:
        """Each pod's requests waiting in its latest scrape, for the pods read at `at` (the tick's
        `observe`) or since (the `snapshot` after a knob change): the queue now, not the window's average,
        which is what rotation weighs."""
        return {url: h[-1].gauges.get(WAITING, 0.0) for url in pod_urls
                if (h := self.history.get(url)) and h[-1].t >= at}

    def _scrape(self, url: str) -> tuple[str | None, str | None]:
        """(metrics text, None) or (None, why not)."""
        try:
            with self.limit if self.limit is not None else contextlib.nullcontext():
                r = pod_client().get(url.rstrip("/") + "/metrics", timeout=self.timeout)
        except httpx.HTTPError as e:
            return None, f"{type(e).__name__}: {e}"
        if r.status_code != 200:
            return None, f"HTTP {r.status_code}"
        return r.text, None
