"""`iterserve bench` on bad input: an unreachable URL, a malformed JSONL file, a server that fails
requests mid-run (HTTP 500, a cut connection, an error inside the stream) and a Ctrl-C. Each gives a
clear message and no traceback, and whatever was measured is written.

The failing server is a real HTTP server (FastAPI under uvicorn) speaking OpenAI's streaming format
the way the official API does: it refuses vLLM's `continuous_usage_stats` and has no /metrics.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from tests.server_support import ROOT, exited, free_port
from tests.waiting import wait_until

BENCH = [sys.executable, "-m", "iterserve.server.entrypoints.cli", "bench"]


def flaky_app(behaviour, token_delay: float = 0.0) -> tuple[FastAPI, list[int]]:
    """An OpenAI-like completions server; `behaviour(n)` says what its n-th accepted request gets:
    "ok", "500", "cut" (the connection drops after two tokens) or "stream-error"."""
    app = FastAPI()
    accepted: list[int] = []

    def err(status, message):
        return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                       "code": None}}, status_code=status)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "flaky", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        if "continuous_usage_stats" in body.get("stream_options", {}):
            return err(400, "Unrecognized request argument supplied: continuous_usage_stats")
        accepted.append(len(accepted) + 1)
        what = behaviour(accepted[-1])
        if what == "500":
            return err(500, "injected failure")

        async def events():
            def chunk(text, finish=None):
                return "data: " + json.dumps({"id": "c", "object": "text_completion", "model": "flaky", "choices": [
                    {"index": 0, "text": text, "finish_reason": finish}]}) + "\n\n"

            n, sent = body["max_tokens"], 0
            for i in range(n):
                await asyncio.sleep(token_delay)
                if what == "cut" and i == 2:
                    raise RuntimeError("injected connection loss")
                if what == "stream-error" and i == 2:
                    yield "data: " + json.dumps({"error": {"message": "injected step failure", "code": 500}}) + "\n\n"
                    break
                yield chunk("x", "length" if i == n - 1 else None)
                sent += 1
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": sent, "total_tokens": sent}
            closing = {"id": "c", "object": "text_completion", "choices": [], "usage": usage}
            yield "data: " + json.dumps(closing) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app, accepted


class AppServer:
    def __init__(self, app):
        self.url = f"http://127.0.0.1:{free_port()}"
        config = uvicorn.Config(app, host="127.0.0.1", port=int(self.url.rsplit(":", 1)[1]), log_level="critical",
                                lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        wait_until(lambda: self.server.started, timeout=30, interval=0.05, what="the test server to start")
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(10)


def _bench(*args, timeout=120):
    return subprocess.run([*BENCH, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _assert_clean_error(proc, status, *phrases):
    assert proc.returncode == status, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr + proc.stdout
    for phrase in phrases:
        assert phrase in proc.stderr, proc.stderr


def test_unreachable_url_is_one_line_and_status_2(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    proc = _bench("--url", url, "--concurrency", "1", "--requests", "2", "--out", str(tmp_path / "o"))
    _assert_clean_error(proc, 2, f"cannot reach {url}")
    assert proc.stderr.count("\n") == 1 and not (tmp_path / "o").exists()


def test_malformed_jsonl_names_the_line_before_sending_anything(tmp_path):
    app, accepted = flaky_app(lambda n: "ok")
    bad = tmp_path / "prompts.jsonl"
    bad.write_text('{"prompt": "one"}\n{"prompt": "two", "max_tokens": 4,}\n')
    with AppServer(app) as srv:
        proc = _bench("--url", srv.url, "--workload", "jsonl", "--jsonl", str(bad), "--concurrency", "1",
                      "--out", str(tmp_path / "o"))
    _assert_clean_error(proc, 2, f"{bad} line 2: not valid JSON")
    assert accepted == []


def test_errors_mid_run_are_recorded_and_the_run_goes_on(tmp_path):
    def behaviour(n):  # n = 1 is the probe request
        return "500" if n % 3 == 0 else "cut" if n % 5 == 0 else "stream-error" if n % 7 == 0 else "ok"

    app, accepted = flaky_app(behaviour)
    out = tmp_path / "o"
    with AppServer(app) as srv:
        proc = _bench("--url", srv.url, "--input-len", "6", "--output-len", "5", "--concurrency", "3",
                      "--requests", "12", "--out", str(out))
    _assert_clean_error(proc, 0)
    assert len(accepted) == 13 and "7 failed" in proc.stdout
    data = json.loads((out / "results.json").read_text())
    assert data["server"]["features"] == {"token_id_prompts": True, "ignore_eos": True, "continuous_usage": False}
    assert data["server"]["metrics"] is False and data["runs"][0]["server_metrics"] is None
    records = data["runs"][0]["records"]
    kinds = [r["error_kind"] for r in records]
    assert (kinds.count(None), kinds.count("http"), kinds.count("connection"), kinds.count("stream")) == (5, 4, 2, 1)
    assert all(r["output_tokens"] == 5 and r["chunk_tokens"] == [1] * 5 for r in records if r["error"] is None)
    assert {r["error"] for r in records if r["error_kind"] == "http"} == {"HTTP 500: injected failure"}
    assert all(r["end"] is not None and r["output_tokens"] == 2 for r in records if r["error_kind"] == "stream")
    summary = data["runs"][0]["summary"]
    assert summary["num_failed"] == 7 and summary["error_rate"] == pytest.approx(7 / 12)
    assert summary["num_errors_by_kind"] == {"http": 4, "connection": 2, "stream": 1}
    assert (out / "latency_cdf.png").exists()


def test_a_run_where_nothing_succeeds_says_so_with_status_1(tmp_path):
    app, _ = flaky_app(lambda n: "ok" if n == 1 else "500")
    with AppServer(app) as srv:
        proc = _bench("--url", srv.url, "--output-len", "3", "--concurrency", "2", "--requests", "4",
                      "--out", str(tmp_path / "o"), "--no-plots")
    _assert_clean_error(proc, 1, "no request succeeded")
    assert json.loads((tmp_path / "o" / "results.json").read_text())["runs"][0]["summary"]["num_failed"] == 4


def test_ctrl_c_keeps_partial_results(tmp_path):
    app, accepted = flaky_app(lambda n: "ok", token_delay=0.3)
    out = tmp_path / "o"
    with AppServer(app) as srv:
        proc = subprocess.Popen([*BENCH, "--url", srv.url, "--output-len", "40", "--concurrency", "2",
                                 "--requests", "6", "--out", str(out)],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        # the probe and the first two requests are being answered
        wait_until(lambda: len(accepted) >= 3, timeout=60, interval=0.05, what="three requests to arrive",
                   fail_if=exited(proc))
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr + stdout and "interrupted" in stderr
    data = json.loads((out / "results.json").read_text())
    assert data["interrupted"] is True
    records = data["runs"][0]["records"]
    assert len(records) == 2 and {r["error_kind"] for r in records} == {"cancelled"}
    assert all(r["output_tokens"] >= 1 for r in records)  # what arrived before the stop is kept


def test_server_refusing_the_request_shape_is_a_clear_error(tmp_path):
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"data": [{"id": "m"}]}

    @app.post("/v1/completions")
    async def completions():
        return JSONResponse({"error": {"message": "model 'm' is overloaded"}}, status_code=400)

    with AppServer(app) as srv:
        proc = _bench("--url", srv.url, "--concurrency", "1", "--out", str(tmp_path / "o"))
        assert httpx.get(srv.url + "/v1/models").status_code == 200
    _assert_clean_error(proc, 2, "refused the request: HTTP 400: model 'm' is overloaded")
