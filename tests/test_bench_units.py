"""`iterserve bench` without a server: workload shapes, figures from records, Prometheus parsing,
compare's warnings and the command line's refusals (table-driven where the logic is a function)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest

from iterserve.bench import compare, report
from iterserve.bench.client import RequestRecord
from iterserve.bench.load import BenchConfig
from iterserve.bench.metrics_scraper import (
    histogram_buckets,
    histogram_delta,
    histogram_quantile,
    parse_metrics,
    summarize_scrapes,
)
from iterserve.bench.result import BenchResult, RunResult
from iterserve.bench.workload import LengthDist, WorkloadError, WorkloadSpec, generate_requests, parse_length
from iterserve.server.entrypoints.cli import main as iterserve_main

# -- workload ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec, expected", [
    ("128", LengthDist("fixed", 128)),
    ("fixed:7", LengthDist("fixed", 7)),
    ("uniform:32:256", LengthDist("uniform", 32, 256)),
    ("lognormal:100:0.5", LengthDist("lognormal", 100, 0.5)),
])
def test_parse_length(spec, expected):
    assert parse_length(spec) == expected


@pytest.mark.parametrize("spec", ["", "abc", "0", "uniform:10", "uniform:20:10", "lognormal:100:-1", "pareto:1:2",
                                  "fixed:1:2", "12.5"])
def test_parse_length_refuses(spec):
    with pytest.raises(WorkloadError, match="--input-len|length"):
        parse_length(spec, "--input-len")


def _requests(**kw):
    n = kw.pop("n", 200)
    return list(generate_requests(WorkloadSpec(**kw), n))


def test_same_seed_same_requests_and_another_seed_differs():
    a, b, c = _requests(seed=3), _requests(seed=3), _requests(seed=4)
    assert a == b
    assert [r.prompt_ids for r in a] != [r.prompt_ids for r in c]


@pytest.mark.parametrize("shape, input_len, output_len", [
    ("short-short", 128, 32), ("short-long", 128, 256), ("long-short", 1024, 32), ("long-long", 1024, 256)])
def test_named_shapes_have_exact_lengths(shape, input_len, output_len):
    for r in _requests(shape=shape, n=5):
        assert (len(r.prompt_ids), r.input_len, r.max_tokens) == (input_len, input_len, output_len)


def test_uniform_and_lognormal_lengths_follow_their_distribution():
    reqs = _requests(input_len=parse_length("uniform:10:20"), output_len=parse_length("lognormal:100:0.5"), n=2000)
    assert {len(r.prompt_ids) for r in reqs} == set(range(10, 21))
    assert 90 <= statistics.median(r.max_tokens for r in reqs) <= 110


def test_mixed_shape_draws_every_class_in_its_share():
    kinds = [r.kind for r in _requests(shape="mixed", n=2000)]
    shares = {k: kinds.count(k) / len(kinds) for k in set(kinds)}
    assert shares.keys() == {"chat", "summarize", "generate"}
    assert abs(shares["chat"] - 0.5) < 0.05 and abs(shares["generate"] - 0.2) < 0.05


def test_lengths_are_clipped_to_the_context_and_ids_stay_in_range():
    for r in _requests(shape="long-long", max_model_len=300, token_range=(40, 50), n=5):
        assert len(r.prompt_ids) + r.max_tokens <= 300 and r.max_tokens >= 1
        assert all(40 <= t < 50 for t in r.prompt_ids)


def test_jsonl_prompts_repeat_in_order(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "hello", "max_tokens": 3}\n\n{"prompt": [5, 6, 7]}\n'
                    '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 9}\n')
    reqs = list(generate_requests(WorkloadSpec("jsonl", jsonl_path=str(path), output_len=parse_length("4")), 4))
    assert [(r.prompt_text, r.prompt_ids, r.max_tokens) for r in reqs[:2]] == [("hello", None, 3), (None, [5, 6, 7], 4)]
    assert reqs[2].messages == [{"role": "user", "content": "hi"}] and reqs[2].max_tokens == 9
    assert reqs[3].prompt_text == "hello"


@pytest.mark.parametrize("line, message", [
    ('{"prompt": "x"', "not valid JSON"),
    ('["x"]', "expected an object"),
    ('{"max_tokens": 3}', "exactly one of"),
    ('{"prompt": "x", "messages": []}', "exactly one of"),
    ('{"prompt": ""}', "non-empty string or a list of token ids"),
    ('{"prompt": [1, -2]}', "non-empty string or a list of token ids"),
    ('{"messages": [{"content": "no role"}]}', "messages"),
    ('{"prompt": "x", "max_tokens": 0}', "max_tokens"),
    ('{"prompt": "x", "max_tokens": "5"}', "max_tokens"),
])
def test_malformed_jsonl_names_file_and_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(WorkloadError, match=rf"bad\.jsonl line 2: .*{message}"):
        WorkloadSpec("jsonl", jsonl_path=str(path))


# -- figures from records ---------------------------------------------------------------------------


def _rec(i, start, chunks, tokens, end, error=None, kind=None):
    return RequestRecord(index=i, kind="t", max_tokens=8, start=start, prompt_tokens=10, output_tokens=sum(tokens),
                         first_token=chunks[0] if chunks else None, end=end, chunk_times=chunks, chunk_tokens=tokens,
                         status=200 if error is None else 500, error=error, error_kind=kind)


RECORDS = [
    _rec(0, 0.0, [0.1, 0.2, 0.4], [1, 1, 1], 0.5),  # ttft 100, itl 100/200, tpot 200, e2e 500
    _rec(1, 0.5, [0.8, 0.9], [1, 2], 1.0),  # ttft 300, itl 100, tpot 100, e2e 500
    _rec(2, 1.0, [], [], 1.01, error="HTTP 500: boom", kind="http"),
]


def test_summary_figures_from_records():
    s = report.summarize(RECORDS, {"ttft": 150, "itl": 150})
    assert (s["num_requests"], s["num_completed"], s["num_failed"]) == (3, 2, 1)
    assert s["error_rate"] == pytest.approx(1 / 3) and s["timeout_rate"] == 0
    assert s["duration_s"] == pytest.approx(1.01)
    assert s["total_output_tokens"] == 6 and s["total_input_tokens"] == 20
    assert s["output_throughput"] == pytest.approx(6 / 1.01)
    assert s["request_throughput"] == pytest.approx(2 / 1.01)
    assert s["ttft_ms"] == pytest.approx({"mean": 200, "p50": 200, "p90": 280, "p99": 298, "max": 300, "count": 2})
    assert s["itl_ms"]["count"] == 3 and s["itl_ms"]["mean"] == pytest.approx(400 / 3)
    assert s["itl_ms"]["p50"] == pytest.approx(100)
    assert s["tpot_ms"]["mean"] == pytest.approx(150) and s["e2e_ms"]["p99"] == pytest.approx(500)
    assert s["goodput"]["num_good"] == 0  # r0 misses itl (a 200 ms gap), r1 misses ttft (300 ms)
    assert s["goodput"]["attainment"] == {"ttft": 0.5, "itl": 0.5}
    assert s["top_errors"] == [["HTTP 500: boom", 1]]


@pytest.mark.parametrize("slo, num_good", [({"ttft": 350}, 2), ({"ttft": 150}, 1), ({"itl": 150}, 1),
                                           ({"tpot": 120}, 1), ({"e2e": 499}, 0), ({}, None)])
def test_goodput_counts_requests_meeting_every_slo(slo, num_good):
    g = report.goodput(RECORDS, slo, duration=2.0)
    assert (g and g["num_good"]) == num_good
    if g:
        assert g["request_rate"] == pytest.approx(num_good / 2.0)


@pytest.mark.parametrize("text, expected", [("ttft=500,itl=100", {"ttft": 500, "itl": 100}), ("", {}),
                                            (" TPOT=20 , e2e=1e4 ", {"tpot": 20, "e2e": 10000})])
def test_parse_slo(text, expected):
    assert report.parse_slo(text) == expected


@pytest.mark.parametrize("text", ["ttft", "ttft=", "ttft=-1", "ttft=abc", "latency=5"])
def test_parse_slo_refuses(text):
    with pytest.raises(ValueError, match="--slo"):
        report.parse_slo(text)


def test_empty_run_has_figures_but_no_latencies():
    s = report.summarize([])
    assert s["num_requests"] == 0 and s["ttft_ms"]["p99"] is None and s["output_throughput"] == 0


# -- Prometheus text --------------------------------------------------------------------------------


def _registry(observations):
    r = CollectorRegistry()
    h = Histogram("vllm:time_to_first_token_seconds", "ttft", ["model_name", "engine"], buckets=[0.1, 0.5, 1.0],
                  registry=r)
    for i, v in enumerate(observations):
        h.labels("m" if i % 2 else "other", "0").observe(v)  # two label sets: summed
    Gauge("vllm:kv_cache_usage_perc", "kv", ["model_name"], registry=r).labels("m").set(0.25)
    Counter("vllm:num_preemptions", "p", ["model_name"], registry=r).labels("m").inc(len(observations))
    Info("vllm:cache_config", "c", registry=r).info({"block_size": "16"})
    return generate_latest(r).decode()


def test_parse_and_delta_of_histograms():
    before = parse_metrics(_registry([0.05]), t=-1)
    after = parse_metrics(_registry([0.05, 0.3, 0.3, 0.7, 2.0]), t=5)
    assert histogram_buckets(after.values, "vllm:time_to_first_token_seconds") == [
        (0.1, 1), (0.5, 3), (1.0, 4), (float("inf"), 5)]
    assert histogram_delta(before, after, "vllm:time_to_first_token_seconds")[-1] == (float("inf"), 4)
    assert after.info == {"vllm:cache_config_info.block_size": "16"}
    s = summarize_scrapes([before, after])
    assert s["preemptions"] == 4 and s["histograms"]["ttft"]["count"] == 4
    assert s["series"]["vllm:kv_cache_usage_perc"] == [[-1, 0.25], [5, 0.25]]


@pytest.mark.parametrize("q, expected", [(0.5, 0.3), (0.25, 0.1), (0.75, 0.5), (1.0, 1.0), (0.0, 0.0)])
def test_histogram_quantile_interpolates_like_prometheus(q, expected):
    buckets = [(0.1, 1.0), (0.5, 3.0), (1.0, 4.0), (float("inf"), 4.0)]
    assert histogram_quantile(q, buckets) == pytest.approx(expected)


def test_histogram_quantile_beyond_last_edge_and_empty():
    assert histogram_quantile(0.99, [(1.0, 1.0), (float("inf"), 10.0)]) == 1.0
    assert histogram_quantile(0.5, [(1.0, 0.0), (float("inf"), 0.0)]) is None


# -- compare ----------------------------------------------------------------------------------------


def _result(settings, records=RECORDS, **config):
    return BenchResult(config={"workload": {"shape": "random"}, "concurrency": 4, **config},
                       server={"settings": settings}, runs=[RunResult("concurrency=4", {"concurrency": 4}, records)])


@pytest.mark.parametrize("b_settings, flagged", [
    ({"max_num_seqs": 64, "policy": "continuous"}, False),
    ({"max_num_seqs": 8, "policy": "continuous"}, False),
    ({"max_num_seqs": 8, "policy": "static"}, True),
    ({"max_num_seqs": 64}, False),
])
def test_compare_flags_more_than_one_setting_change(b_settings, flagged):
    a = _result({"max_num_seqs": 64, "policy": "continuous"})
    found = compare.warnings(a, _result(b_settings))
    assert any("settings differ" in w for w in found) == flagged


def test_compare_flags_workload_and_load_changes_and_gives_ratios():
    a = _result({})
    b = _result({}, records=RECORDS[:1], concurrency=8)
    assert compare.warnings(a, b) == ["the load differs (concurrency)"]
    by_figure = {label: (va, vb, r, better) for _, label, va, vb, r, better in compare.rows(a, b)}
    va, vb, r, better = by_figure["TTFT p50 ms"]
    assert (va, vb) == pytest.approx((200, 100)) and r == pytest.approx(0.5) and better == "B"
    assert by_figure["error rate"][3] == "B"  # 1/3 -> 0: lower is better


def test_result_json_round_trip(tmp_path):
    a = _result({"policy": "static"}, slo_ms={"ttft": 150})
    path = a.save(tmp_path)
    back = BenchResult.from_json(json.loads(path.read_text()))
    assert back.to_json() == a.to_json()


# -- configuration and command line -----------------------------------------------------------------


@pytest.mark.parametrize("kwargs, message", [
    ({}, "exactly one of --concurrency and --rate"),
    ({"concurrency": 2, "rate": 1.0}, "exactly one of"),
    ({"concurrency": 0}, "--concurrency must be >= 1"),
    ({"rate": 0.0}, "--rate must be > 0"),
    ({"rate": 1.0, "burstiness": 0}, "--burstiness"),
    ({"concurrency": 1, "num_requests": 0}, "--requests"),
    ({"concurrency": 1, "sweep": (1, 2.5)}, "--sweep"),
    ({"concurrency": 1, "endpoint": "embeddings"}, "--endpoint"),
])
def test_config_refusals_name_the_option(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BenchConfig(url="http://x", **kwargs)


@pytest.mark.parametrize("argv, message", [
    ([], "--url and --out are required"),
    (["--url", "ftp://x", "--out", "o", "--concurrency", "1"], "--url must start with http"),
    (["--url", "http://x", "--out", "o", "--rate", "fast"], "'fast' is not a number"),
    (["--url", "http://x", "--out", "o", "--sweep", "threads=1,2"], "--sweep: write"),
    (["--url", "http://x", "--out", "o", "--sweep", "rate=1,2", "--rate", "3"], "drop --concurrency/--rate"),
    (["--url", "http://x", "--out", "o", "--concurrency", "1", "--input-len", "uniform:9"], "--input-len"),
    (["--url", "http://x", "--out", "o", "--concurrency", "1", "--slo", "ttft"], "--slo"),
    (["--url", "http://x", "--out", "o", "--concurrency", "1", "--setting", "policy"], "--setting"),
    (["--url", "http://x", "--out", "o", "--concurrency", "1", "--workload", "jsonl"], "needs --jsonl"),
    (["--url", "http://x", "--out", "o", "--concurrency", "1", "--prompt-token-range", "9:3"], "token-range"),
])
def test_cli_refusals_are_one_line_with_status_2(argv, message, capsys):
    assert iterserve_main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_compare_refuses_a_file_that_is_not_a_result(tmp_path, capsys):
    bad = tmp_path / "x.json"
    bad.write_text('{"hello": 1}')
    assert iterserve_main(["bench", "compare", str(bad), str(bad)]) == 2
    assert "cannot read a bench result" in capsys.readouterr().err


def test_bench_imports_no_engine_internals():
    """The bench is a client: it must work without torch or the engine (and stay cheap to import)."""
    code = ("import sys, iterserve.bench.cli, iterserve.bench.console, iterserve.bench.plots;"
            "bad = [m for m in sys.modules if m == 'torch' or m.split('.')[:3] in "
            "(['iterserve','server','engine'], ['iterserve','server','model'], ['iterserve','server','runner'],"
            " ['iterserve','server','api'])]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_tokenizer_makes_text_prompts_exact(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from iterserve.bench.workload import WORDS

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(dict.fromkeys(WORDS))}, unk_token="the"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    plain = _requests(input_len=parse_length("uniform:5:30"), n=20)
    exact = _requests(input_len=parse_length("uniform:5:30"), n=20, tokenizer_path=str(tmp_path))
    assert [r.prompt_ids for r in exact] == [r.prompt_ids for r in plain]  # the tokenizer changes no draw
    for r in exact:
        assert len(tok.encode(r.text(), add_special_tokens=False).ids) == r.input_len
    with pytest.raises(WorkloadError, match="--tokenizer"):
        WorkloadSpec(tokenizer_path=str(tmp_path / "missing.json"))
