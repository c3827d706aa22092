"""The tuner against real `iterserve serve` processes under load made by `iterserve bench`'s Python API:
reading the pods' /metrics directly, then through a real Prometheus. Requests that queue behind
max_num_seqs=1 breach a TTFT objective set from the machine's own speed (4x one request's latency): the tuner raises
max_num_seqs on every pod, live, and the
measured p99 TTFT falls. A KV cache too small for the batch makes the server preempt: the tuner backs
max_num_seqs off until it stops. Short intervals and windows keep this to well under three minutes."""

from __future__ import annotations

import math
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from iterserve.bench.load import BenchConfig, run_bench
from iterserve.bench.workload import WorkloadSpec, parse_length
from iterserve.common.wire import Knobs
from iterserve.operator.tuning.decide import BACK_OFF_SEQS, RAISE_SEQS
from iterserve.operator.tuning.histograms import histogram_quantile
from iterserve.operator.tuning.observe import PodScraper
from iterserve.operator.tuning.pod_admin import get_scheduler, patch_scheduler
from iterserve.operator.tuning.policy import TuningPolicy
from iterserve.operator.tuning.prometheus import PrometheusSource
from iterserve.operator.tuning.tuner import Tuner
from tests.prometheus_support import require_prometheus, start_prometheus
from tests.server_support import start_subprocess

TOKEN = "admin-secret-for-tests"
QUEUED = Knobs(max_num_seqs=1, max_num_batched_tokens=512, prefill_chunk_size=256)
# 8 clients per pod, 64-token prompts, 32 tokens out: with one place in the batch, 7 requests wait
WORKLOAD = WorkloadSpec("random", input_len=parse_length("64"), output_len=parse_length("32"))
POLICY = TuningPolicy(ttft_p99_ms=600, itl_p99_ms=1000, max_num_seqs_bounds=(1, 16), interval_s=2, window_s=3,
                      cooldown_s=2, min_samples=5, seqs_step=3)


def serve(model: str, kv: str, seqs: int):
    return start_subprocess("--model", model, "--kv-cache-memory", kv, "--threads", "1", "--max-model-len", "256",
                            "--max-num-seqs", str(seqs), "--admin-token", TOKEN)


@pytest.fixture(scope="module")
def pods(tiny_dir):
    """Two pods of one service, each with a KV cache for about 10 of the test's requests (64 blocks)."""
    model = tiny_dir
    with ThreadPoolExecutor(2) as pool:
        started = list(pool.map(lambda _: serve(model, "512KiB", 1), range(2)))
    yield [url for _, url in started]
    for proc, _ in started:
        proc.terminate()
    for proc, _ in started:
        proc.wait(30)


class Load:
    """Closed-loop load on each URL from `iterserve bench` until stopped."""

    def __init__(self, urls: list[str], concurrency: int):
        self.stop = threading.Event()
        configs = [BenchConfig(url=u, concurrency=concurrency, num_requests=None, duration_s=300, workload=WORKLOAD)
                   for u in urls]
        self.threads = [threading.Thread(target=run_bench, args=(c, self.stop), daemon=True) for c in configs]

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(60)


def run_tuner(tuner: Tuner, until, timeout: float = 45.0) -> list:
    """Tick every interval until `until(records)` holds or the time is up."""
    records, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(tuner.policy.interval_s)
        records.append(tuner.tick())
        r = records[-1]
        print(f"{r.decision.action} {r.knobs.max_num_seqs} {r.decision.tuned.reason}: {r.decision.reason}")
        if until(records):
            break
    return records


def settled_with_slo_met(records) -> bool:
    return len(records) >= 2 and all(r.decision.tuned.status == "True" and not r.changed for r in records[-2:])


def judged(records) -> list:
    return [r for r in records if r.decision.slo_met is not None]


def assert_raised_and_ttft_fell(tuner: Tuner, records, urls, configmap) -> None:
    slo_ms = tuner.policy.ttft_p99_ms
    decisions = [(r.decision.action, r.decision.reason) for r in records]
    actions = [a for a, _ in decisions]
    assert RAISE_SEQS in actions, decisions
    # the queue breached TTFT by the first raise (the very first window may close before the queue has grown)
    before = judged(records[:actions.index(RAISE_SEQS) + 1])
    worst = max(before, key=lambda r: r.observation.ttft_p99_s)
    assert worst.observation.ttft_p99_s * 1000 > slo_ms, decisions
    knobs = tuner.state.knobs
    assert knobs.max_num_seqs > 1
    for url in urls:  # in force on every pod, live
        assert get_scheduler(url, TOKEN)["knobs"] == knobs.as_dict()
    assert configmap[-1] == knobs  # and where new pods would read them
    # the p99 responded: from over its SLO to within it, and the tuner settled there (Tuned=True, no change
    # in the last two ticks). Not "halved": the tuner holds once p99 is inside the hysteresis band (80-100%
    # of the SLO), so a breach under 2x the SLO may settle above half of it (a CI run on a slow machine:
    # 494 ms -> 271 ms against 275 ms)
    assert settled_with_slo_met(records), decisions
    settled = min(r.observation.ttft_p99_s for r in judged(records)[-2:])
    assert settled * 1000 <= slo_ms < worst.observation.ttft_p99_s * 1000, decisions


@pytest.fixture(scope="module")
def queue_policy(pods):
    """POLICY with a TTFT objective of 4x one request's unloaded latency on these pods: behind one place in
    the batch 7 requests wait (~7x, a breach on any machine), with 7 or more places about none do."""
    patch_scheduler(pods[0], TOKEN, QUEUED.as_dict())
    alone = run_bench(BenchConfig(url=pods[0], concurrency=1, num_requests=5, workload=WORKLOAD))
    latency = statistics.median(r.end - r.start for r in alone.runs[0].records if r.ok)
    return POLICY.replace(ttft_p99_ms=round(4000 * latency))


@pytest.fixture
def service(pods):
    urls = pods
    for url in urls:
        patch_scheduler(url, TOKEN, QUEUED.as_dict())
    return urls


def make_tuner(urls, policy, source, configmap):
    return Tuner("team-a", "chat", list_pods=lambda: urls, admin_token=TOKEN, policy=policy, source=source,
                 knobs=QUEUED, apply_knobs=configmap.append)


def test_queueing_raises_max_num_seqs_reading_pods_directly(service, queue_policy):
    configmap = []
    tuner = make_tuner(service, queue_policy, PodScraper(), configmap)
    with Load(service, concurrency=8):
        tuner.tick()  # the first scrape: a window needs two
        records = run_tuner(tuner, settled_with_slo_met)
    assert_raised_and_ttft_fell(tuner, records, service, configmap)


def test_queueing_raises_max_num_seqs_reading_prometheus(service, queue_policy, tmp_path):
    require_prometheus()
    prom = start_prometheus(tmp_path / "prometheus", service, labels={"service": "chat"})
    try:
        prom.wait_for_targets(2)
        configmap = []
        policy = queue_policy.replace(interval_s=3, window_s=4, cooldown_s=3)  # rate() needs 2+ scrapes (1 s apart)
        tuner = make_tuner(service, policy, PrometheusSource(prom.url, selector='service="chat"'), configmap)
        with Load(service, concurrency=8):
            records = run_tuner(tuner, settled_with_slo_met, timeout=60)
            assert_prometheus_quantile_matches_ours(prom)
        assert all(r.observation.num_pods == 2 for r in judged(records))
        assert_raised_and_ttft_fell(tuner, records, service, configmap)
    finally:
        prom.stop()


def assert_prometheus_quantile_matches_ours(prom) -> None:
    """Prometheus' own histogram_quantile and ours on the same stored buckets give the same p99."""
    name = "vllm:time_to_first_token_seconds_bucket"
    at = time.time() - 1  # a moment Prometheus has surely ingested
    theirs = prom.query(f'histogram_quantile(0.99, sum by (le) ({name}{{service="chat"}}))', at)
    buckets = {float(s["metric"]["le"]): float(s["value"][1])
               for s in prom.query(f'sum by (le) ({name}{{service="chat"}})', at)}
    assert len(theirs) == 1 and buckets.get(math.inf, 0) > 0
    assert histogram_quantile(0.99, buckets) == pytest.approx(float(theirs[0]["value"][1]), rel=1e-9)


def test_preemptions_back_max_num_seqs_off(pods):
    url = pods[0]  # 16 requests of 6 blocks each do not fit its 64 blocks
    start = Knobs(max_num_seqs=16, max_num_batched_tokens=512, prefill_chunk_size=256)
    patch_scheduler(url, TOKEN, start.as_dict())
    configmap = []
    policy = POLICY.replace(ttft_p99_ms=60_000, itl_p99_ms=10_000, max_num_seqs_bounds=(1, 16))
    tuner = Tuner("team-a", "small", list_pods=lambda: [url], admin_token=TOKEN, policy=policy, source=PodScraper(),
                  knobs=start, apply_knobs=configmap.append)

    def quiet(records):  # a judged window without preemptions after a back-off
        return any(r.decision.action == BACK_OFF_SEQS for r in records) and \
            judged(records)[-1].observation.preemption_rate == 0

    with Load([url], concurrency=16):
        tuner.tick()
        records = run_tuner(tuner, quiet)
    decisions = [(r.decision.action, r.decision.reason) for r in records]
    first = judged(records)[0]
    assert first.observation.preemption_rate > 0, decisions
    backoffs = [r for r in records if r.decision.action == BACK_OFF_SEQS]
    assert backoffs and "preemptions" in backoffs[0].decision.reason, decisions
    assert tuner.state.knobs.max_num_seqs < 16
    assert get_scheduler(url, TOKEN)["knobs"]["max_num_seqs"] == tuner.state.knobs.max_num_seqs
    assert judged(records)[-1].observation.preemption_rate == 0, decisions
