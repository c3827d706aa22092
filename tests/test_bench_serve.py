"""`iterserve bench` against a real `iterserve serve` on the bundled default model (one server for the
module): a closed-loop run through the command line and a Poisson run through the Python API complete;
every figure in the JSON is recomputed here from the raw records; the plots are PNGs; the client's
TTFT agrees with the server's own histogram within one bucket; the stop event and the duration limit
that the tuner relies on end a run cleanly."""

from __future__ import annotations

import json
import math
import random
import statistics
import subprocess
import sys
import threading

import httpx
import pytest
from PIL import Image

from iterserve.bench.load import BenchConfig, Progress, run_bench
from iterserve.bench.plots import write_plots
from iterserve.bench.report import e2e, fraction_at_or_below, itls, tpot, ttft
from iterserve.bench.result import RunResult
from iterserve.bench.workload import WorkloadSpec, parse_length
from tests.server_support import ROOT, metric_value, start_subprocess

pytestmark = pytest.mark.slow

OUTPUT_LEN = 8
SUMMARY_KEYS = {"num_requests", "num_completed", "num_failed", "num_errors_by_kind", "error_rate", "timeout_rate",
                "top_errors", "duration_s", "total_input_tokens", "total_output_tokens", "request_throughput",
                "output_throughput", "total_token_throughput", "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "goodput"}
TTFT = "vllm:time_to_first_token_seconds"


@pytest.fixture(scope="module")
def server():
    proc, url = start_subprocess("--threads", "1", "--max-model-len", "256", "--kv-cache-memory", "32MiB",
                                 "--max-num-seqs", "8")
    yield url
    proc.terminate()
    proc.communicate(timeout=60)


def _pct(values, q):
    """The q-th percentile by linear interpolation, computed independently of numpy."""
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def _assert_figures_match_records(run: dict, slo: dict):
    records = RunResult.from_json(run).records
    s = run["summary"]
    assert SUMMARY_KEYS <= s.keys()
    ok = [r for r in records if r.ok]
    assert s["num_completed"] == len(ok) == len(records)
    duration = max(r.end for r in records) - min(r.start for r in records)
    assert s["duration_s"] == pytest.approx(duration)
    assert s["total_output_tokens"] == sum(r.output_tokens for r in ok) == OUTPUT_LEN * len(ok)
    assert all(r.prompt_tokens == r.input_len and sum(r.chunk_tokens) == r.output_tokens for r in ok)
    assert s["output_throughput"] == pytest.approx(s["total_output_tokens"] / duration)
    assert s["request_throughput"] == pytest.approx(len(ok) / duration)
    for key, values in (("ttft_ms", [ttft(r) for r in ok]), ("e2e_ms", [e2e(r) for r in ok]),
                        ("tpot_ms", [tpot(r) for r in ok]), ("itl_ms", [g for r in ok for g in itls(r)])):
        ms = [1000 * v for v in values]
        assert s[key]["count"] == len(ms)
        assert s[key]["mean"] == pytest.approx(statistics.fmean(ms))
        for q in (50, 90, 99):
            assert s[key][f"p{q}"] == pytest.approx(_pct(ms, q)), (key, q)
    good = [r for r in ok if 1000 * ttft(r) <= slo["ttft"] and 1000 * max(itls(r), default=0) <= slo["itl"]]
    assert s["goodput"]["num_good"] == len(good)
    assert s["goodput"]["request_rate"] == pytest.approx(len(good) / duration)
    assert s["error_rate"] == 0 and s["timeout_rate"] == 0


def _ttft_buckets(url: str) -> list[tuple[float, float]]:
    text = httpx.get(url + "/metrics").text
    return [(le, metric_value(text, f"{TTFT}_bucket", le=str(le) if le != math.inf else "+Inf"))
            for le in [0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, math.inf]]


def _assert_png(path):
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(path) as im:
        im.verify()


def test_closed_loop_cli_run_figures_plots_and_server_agreement(server, tmp_path):
    slo = {"ttft": 3000.0, "itl": 800.0}
    before = _ttft_buckets(server)
    out = tmp_path / "closed"
    # a scrape every 0.1 s: the 12 requests take about a second, and at 0.5 s each scrape could fall outside
    # them (KV usage 0 in every sample: 1 run in 3 on the 2-core VM)
    proc = subprocess.run(
        [sys.executable, "-m", "iterserve.server.entrypoints.cli", "bench", "--url", server,
         "--input-len", "uniform:8:40", "--output-len", str(OUTPUT_LEN), "--requests", "12", "--concurrency", "4",
         "--slo", "ttft=3000,itl=800", "--setting", "policy=continuous", "--metrics-interval", "0.1",
         "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "results:" in proc.stdout
    after = _ttft_buckets(server)
    data = json.loads((out / "results.json").read_text())
    assert data["interrupted"] is False and data["config"]["concurrency"] == 4
    assert data["server"]["settings"] == {"model": "SmolLM2-135M-Instruct", "max_model_len": 256, "max_num_seqs": 8,
                                          "max_num_batched_tokens": 2048, "prefill_chunk_size": 2048,
                                          "policy": "continuous"}
    (run,) = data["runs"]
    _assert_figures_match_records(run, slo)
    assert max(r["start"] for r in run["records"]) > 0.1  # closed loop: later requests wait for a free slot

    server_side = run["server_metrics"]
    assert server_side["preemptions"] == 0 and server_side["generation_tokens"] == 12 * OUTPUT_LEN
    assert server_side["knobs_before"] == server_side["knobs_after"] == {
        "max_num_seqs": 8, "max_num_batched_tokens": 2048, "prefill_chunk_size": 2048}
    assert 0 < server_side["kv_cache_usage"]["max"] <= 1 and len(server_side["series"]["vllm:kv_cache_usage_perc"]) >= 3
    assert server_side["histograms"]["queue"]["count"] == 12
    # The bench's own before/after delta is this test's delta minus the one probe request sent first.
    bench = {le if le != "+Inf" else math.inf: c for le, c in server_side["histograms"]["ttft"]["buckets"]}
    probe = [a - b - bench[le] for (le, a), (_, b) in zip(after, before, strict=True)]
    assert probe[-1] == 1 and all(p in (0, 1) for p in probe) and probe == sorted(probe)
    # Client TTFT >= server TTFT (the client's clock starts before the server sees the request and stops
    # after the chunk is sent), and no request's overhead spans more than one bucket.
    edges = [le for le, _ in after]
    client = fraction_at_or_below([ttft(r) for r in RunResult.from_json(run).records], edges)
    server_frac = [bench[le] / bench[math.inf] for le in edges]
    for i, edge in enumerate(edges):
        assert client[i] <= server_frac[i] + 1e-9, (edge, client, server_frac)
        if i > 0:
            assert client[i] >= server_frac[i - 1] - 1e-9, (edge, client, server_frac)
    for name in ("latency_cdf.png", "timeline.png"):
        _assert_png(out / name)


def test_poisson_run_through_the_python_api(server, tmp_path):
    workload = WorkloadSpec("short-short", input_len=parse_length("16"), output_len=parse_length(str(OUTPUT_LEN)),
                            seed=7)
    config = BenchConfig(url=server, workload=workload, rate=3.0, num_requests=10, slo_ms={"ttft": 3000, "itl": 800})
    finished = []

    class Count(Progress):
        def finish_request(self, record):
            finished.append(record.index)

    result = run_bench(config, progress=Count())
    (run,) = result.runs
    assert sorted(finished) == list(range(10)) and not result.interrupted
    assert result.server["features"] == {"token_id_prompts": True, "ignore_eos": True, "continuous_usage": True}
    # Arrivals follow the seeded gamma(1) = Poisson schedule: no request starts before its time.
    gaps = random.Random(workload.seed + 1)
    at, starts = 0.0, sorted(r.start for r in run.records)
    for start in starts:
        assert start >= at - 0.005
        at += gaps.gammavariate(1.0, 1 / 3.0)
    data = json.loads(result.save(tmp_path).read_text())
    _assert_figures_match_records(data["runs"][0], {"ttft": 3000, "itl": 800})
    paths = write_plots(result, tmp_path)
    for p in paths:
        _assert_png(p)


def test_stop_event_and_duration_end_an_endless_run(server):
    workload = WorkloadSpec(input_len=parse_length("8"), output_len=parse_length("4"))
    stop = threading.Event()

    done = []

    class StopAfterThree(Progress):
        def finish_request(self, record):
            done.append(record)
            if len(done) >= 3:
                stop.set()

    result = run_bench(BenchConfig(url=server, workload=workload, concurrency=2, num_requests=None), stop,
                       StopAfterThree())
    (run,) = result.runs
    assert result.interrupted and run.interrupted
    kinds = [r.error_kind for r in run.records]
    assert kinds.count(None) >= 3 and set(kinds) <= {None, "cancelled"} and len(run.records) <= 5

    timed = run_bench(BenchConfig(url=server, workload=workload, concurrency=2, num_requests=None, duration_s=1.0))
    records = timed.runs[0].records
    assert not timed.interrupted and records and all(r.ok for r in records)
    assert max(r.start for r in records) < 1.0 < max(r.end for r in records)


def test_chat_endpoint_with_prompts_from_jsonl(server, tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 5}\n'
                    '{"prompt": "What is the capital of France?"}\n{"prompt": [40, 41, 42, 43]}\n')
    workload = WorkloadSpec("jsonl", jsonl_path=str(path), output_len=parse_length("3"))
    result = run_bench(BenchConfig(url=server, workload=workload, endpoint="chat", concurrency=3, num_requests=3))
    records = sorted(result.runs[0].records, key=lambda r: r.index)
    assert [r.error for r in records] == [None] * 3
    # the assistant-role chunk that opens a chat stream carries no token and is not counted
    assert [(r.output_tokens, sum(r.chunk_tokens)) for r in records] == [(5, 5), (3, 3), (3, 3)]
    assert all(r.prompt_tokens > 4 for r in records)  # the chat template wraps every prompt
