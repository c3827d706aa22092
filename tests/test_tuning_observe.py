"""Observations from scrapes: PromQL's histogram_quantile on a table of buckets, windows over successive
scrapes of text rendered by prometheus-client with the server's metric names and buckets, pods merged by
summing buckets, and a pod restart (counters reset) counted from zero."""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from iterserve.operator.tuning.histograms import histogram_quantile
from iterserve.operator.tuning.observe import PodScraper, observation_from_scrapes, parse_scrape, window_scrapes
from iterserve.operator.tuning.prometheus import instance_selector, promql_queries

INF = math.inf
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]


@pytest.mark.parametrize("q, buckets, want", [
    (0.5, {1: 0, 2: 10, INF: 10}, 1.5),  # interpolated inside (1, 2]
    (0.99, {1: 0, 2: 10, INF: 10}, 1.99),
    (0.5, {1: 10, 2: 10, INF: 10}, 0.5),  # the first bucket interpolates from 0
    (0.99, {1: 5, 2: 5, INF: 10}, 2.0),  # rank in +Inf: the highest finite bound
    (0.5, {0.1: 2, 0.2: 6, 0.4: 10, INF: 10}, 0.175),
    (0.5, {1: 4, 2: 3, INF: 8}, 1.0),  # non-monotonic counts (rates of buckets crossed) are made monotonic
    (0.99, {1: 0, 2: 0, INF: 0}, None),  # no observation: NaN in PromQL
    (0.99, {1: 3, 2: 5}, None),  # no +Inf bucket
    (0.99, {INF: 5}, None),  # fewer than two buckets
    (0.5, {-1: 2, 1: 4, INF: 4}, -1),  # rank in a first bucket with a bound <= 0: that bound
])
def test_histogram_quantile_matches_promql(q, buckets, want):
    got = histogram_quantile(q, buckets)
    assert got == pytest.approx(want) if want is not None else got is None


class FakePodMetrics:
    """A pod's /metrics as the server renders it: prometheus-client, vLLM's names, labels and buckets."""

    def __init__(self):
        r = self.registry = CollectorRegistry()
        lv = dict(model_name="m", engine="0")
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "", list(lv), buckets=TTFT_BUCKETS,
                              registry=r).labels(**lv)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "", list(lv), buckets=ITL_BUCKETS,
                             registry=r).labels(**lv)
        self.queue = Histogram("vllm:request_queue_time_seconds", "", list(lv), buckets=[0.5, 1, 5],
                               registry=r).labels(**lv)
        self.in_batch = Histogram("vllm:request_inference_time_seconds", "", list(lv), buckets=[0.5, 1, 5],
                                  registry=r).labels(**lv)
        success = Counter("vllm:request_success", "", list(lv) + ["finished_reason"], registry=r)
        self.stop = success.labels(**lv, finished_reason="stop")
        self.length = success.labels(**lv, finished_reason="length")
        self.tokens = Counter("vllm:generation_tokens", "", list(lv), registry=r).labels(**lv)
        self.preemptions = Counter("vllm:num_preemptions", "", list(lv), registry=r).labels(**lv)
        self.failures = Counter("iterserve:engine_step_failures", "", ["model_name"], registry=r).labels("m")
        self.responses = Counter("iterserve:http_responses", "", ["model_name", "route", "code"], registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "", list(lv), registry=r).labels(**lv)
        self.kv = Gauge("vllm:kv_cache_usage_perc", "", list(lv), registry=r).labels(**lv)

    def requests(self, n: int, ttft: float, itl: float, queue: float = 0.0, in_batch: float = 0.0) -> None:
        for i in range(n):
            self.ttft.observe(ttft)
            self.itl.observe(itl)
            self.queue.observe(queue)
            self.in_batch.observe(in_batch)
            (self.stop if i % 2 else self.length).inc()
            self.tokens.inc(10)

    def scrape(self, t: float):
        return parse_scrape(generate_latest(self.registry).decode(), t)


def test_window_over_scrapes_of_one_pod():
    pod = FakePodMetrics()
    pod.requests(50, ttft=3.0, itl=0.3)  # before the window: must not count
    scrapes = [pod.scrape(0.0)]
    pod.waiting.set(4)
    pod.kv.set(0.5)
    pod.requests(100, ttft=0.05, itl=0.02, queue=0.2, in_batch=0.4)
    pod.preemptions.inc(3)
    scrapes.append(pod.scrape(10.0))
    pod.waiting.set(0)
    pod.kv.set(0.3)
    scrapes.append(pod.scrape(20.0))
    obs = observation_from_scrapes({"http://a": window_scrapes(scrapes, 20.0, 20.0, None)}, 20.0)
    assert obs.num_pods == 1 and obs.num_samples == 100 and obs.window_s == 20
    assert 0.04 < obs.ttft_p99_s <= 0.06 and 0.01 < obs.itl_p99_s <= 0.025
    assert obs.request_rate == pytest.approx(5.0) and obs.generation_token_rate == pytest.approx(50.0)
    assert obs.preemption_rate == pytest.approx(0.15) and obs.error_rate == 0
    assert obs.waiting == pytest.approx(4 / 3) and obs.kv_usage == pytest.approx(0.8 / 3)  # gauges: scrape means
    assert obs.queue_time_mean_s == pytest.approx(0.2)
    # no running gauge was set: the batch is known by Little's law, 5 requests/s x 0.4 s in the batch
    assert obs.running == 0 and obs.inference_time_mean_s == pytest.approx(0.4) and obs.in_batch == pytest.approx(2)


def test_waiting_now_is_each_pods_latest_scrape_of_this_tick():
    """Rotation's reading: the gauge now (not the window's mean), for the pods read at the tick's
    observation or by the snapshot after a knob change later in the tick; a pod last read before is left
    out."""
    a, b, c = FakePodMetrics(), FakePodMetrics(), FakePodMetrics()
    scraper = PodScraper()
    for pod, waiting in ((a, 30), (b, 2), (c, 7)):
        pod.waiting.set(waiting)
    scraper.history = {"http://a": deque([a.scrape(0.0), a.scrape(20.0)]), "http://b": deque([b.scrape(20.0)]),
                       "http://c": deque([c.scrape(0.0)])}
    assert scraper.waiting_now(["http://a", "http://b", "http://c", "http://d"], 20.0) == {"http://a": 30,
                                                                                             "http://b": 2}
    a.waiting.set(25)
    scraper.history["http://a"].append(a.scrape(20.4))  # the snapshot after a knob change
    assert scraper.waiting_now(["http://a"], 20.0) == {"http://a": 25}


def test_errors_are_failed_steps_and_5xx_answers_not_429s():
    pod = FakePodMetrics()
    first = pod.scrape(0.0)
    pod.requests(20, ttft=0.05, itl=0.02)
    route = "/v1/completions"
    pod.responses.labels("m", route, "200").inc(20)
    pod.responses.labels("m", route, "429").inc(50)  # queue full: a call for capacity, not a failure
    pod.responses.labels("m", route, "503").inc(3)
    pod.responses.labels("m", "/v1/chat/completions", "500").inc(2)
    pod.failures.inc(5)
    obs = observation_from_scrapes({"a": [first, pod.scrape(10.0)]}, 10.0)
    assert obs.error_rate == pytest.approx((3 + 2 + 5) / 10)


def test_window_never_reaches_back_past_a_change():
    pod = FakePodMetrics()
    scrapes = [pod.scrape(0.0)]
    pod.requests(40, ttft=4.0, itl=0.3)  # under the old knobs
    scrapes.append(pod.scrape(10.0))  # the change happened just after this scrape
    pod.requests(40, ttft=0.05, itl=0.02)
    scrapes.append(pod.scrape(20.0))
    whole = observation_from_scrapes({"a": window_scrapes(scrapes, 20.0, 30.0, None)}, 20.0)
    after = observation_from_scrapes({"a": window_scrapes(scrapes, 20.0, 30.0, since=9.0)}, 20.0)
    assert whole.num_samples == 80 and whole.ttft_p99_s > 2.5
    assert after.num_samples == 40 and after.ttft_p99_s <= 0.06
    # nothing taken after the change yet: no window at all
    assert window_scrapes(scrapes, 20.0, 30.0, since=20.0) == []


def test_pods_merge_by_summing_buckets():
    fast, slow = FakePodMetrics(), FakePodMetrics()
    windows = {}
    for url, pod, ttft in (("a", fast, 0.05), ("b", slow, 0.9)):
        first = pod.scrape(0.0)
        pod.requests(90 if url == "a" else 10, ttft=ttft, itl=0.02)
        pod.kv.set(0.9 if url == "b" else 0.1)
        windows[url] = [first, pod.scrape(10.0)]
    obs = observation_from_scrapes(windows, 10.0)
    assert obs.num_pods == 2 and obs.num_samples == 100
    assert obs.request_rate == pytest.approx(10.0)
    assert 0.75 < obs.ttft_p99_s <= 1.0  # the slow pod's 10% dominate the merged p99
    assert obs.kv_usage == pytest.approx(0.45)  # the fuller pod: its mean over the window


def test_pod_restart_counts_from_zero():
    pod = FakePodMetrics()
    pod.requests(500, ttft=0.05, itl=0.02)
    before = pod.scrape(0.0)
    restarted = FakePodMetrics()  # a new process: every counter starts again
    restarted.requests(30, ttft=0.9, itl=0.2)
    after = restarted.scrape(10.0)
    obs = observation_from_scrapes({"a": [before, after]}, 10.0)
    assert obs.num_samples == 30 and obs.request_rate == pytest.approx(3.0)
    assert 0.75 < obs.ttft_p99_s <= 1.0


def test_too_few_scrapes_give_no_rates_yet():
    pod = FakePodMetrics()
    pod.requests(10, ttft=0.05, itl=0.02)
    obs = observation_from_scrapes({"a": [pod.scrape(0.0)]}, 0.0)
    assert obs.num_samples == 0 and obs.ttft_p99_s is None and obs.request_rate == 0
    assert observation_from_scrapes({}, 0.0) is None
    unreadable = observation_from_scrapes({"a": []}, 5.0, errors=["a/metrics: ConnectError"])
    assert unreadable.num_pods == 0 and unreadable.errors == ("a/metrics: ConnectError",)


def test_promql_selects_the_pods_and_quotes_the_regex():
    sel = instance_selector(["http://10.0.0.7:8000", "http://10.0.0.8:8000/"])
    assert sel == 'instance=~"10\\\\.0\\\\.0\\\\.7:8000|10\\\\.0\\\\.0\\\\.8:8000"'
    q = promql_queries('service="chat"', "60000ms")
    assert q["ttft_p99_s"] == ('histogram_quantile(0.99, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket'
                               '{service="chat"}[60000ms])))')
    assert q["kv_usage"].startswith("max(avg_over_time(vllm:kv_cache_usage_perc{")


class SlowMetrics(ThreadingHTTPServer):
    """/metrics on loopback that takes 0.2 s to answer and counts the requests in flight at once."""

    def __init__(self):
        self.lock, self.in_flight, self.most, self.served = threading.Lock(), 0, 0, 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                with server.lock:
                    server.in_flight += 1
                    server.most = max(server.most, server.in_flight)
                time.sleep(0.2)
                with server.lock:
                    server.in_flight -= 1
                    server.served += 1
                body = generate_latest(FakePodMetrics().registry)
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)


@pytest.mark.parametrize("bound", [None, 2])
def test_scrapes_in_flight_are_bounded_across_services(bound):
    """Two services' scrapers, ticking at once, share the operator's bound; without one they overlap freely."""
    server = SlowMetrics()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    limit = threading.BoundedSemaphore(bound) if bound else None
    urls = [f"http://127.0.0.1:{server.server_address[1]}/pod-{i}" for i in range(4)]  # distinct pods
    try:
        ticks = [threading.Thread(target=PodScraper(timeout=10, limit=limit).snapshot, args=(urls, 0.0))
                 for _ in range(2)]
        for tick in ticks:
            tick.start()
        for tick in ticks:
            tick.join()
    finally:
        server.shutdown()
    assert server.served == 8
    assert server.most == 2 if bound else server.most > 2
