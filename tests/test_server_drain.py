"""`iterserve serve` as a process: SIGTERM under load drains (readiness fails at once, new requests get
503, every in-flight request completes, keep-alive connections close so that clients reconnect elsewhere)
and the process exits 0; the API key comes from the env."""

from __future__ import annotations

import asyncio
import http.client
import json
import signal
import subprocess
import sys
import time

import httpx

from tests.server_support import start_subprocess

KEY = {"Authorization": "Bearer env-key-for-the-tests"}


async def _stream(client, url, started: asyncio.Event, counter: list) -> dict:
    body = {"prompt": [5, 6, 7], "max_tokens": 300, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    usage, finish = None, None
    async with client.stream("POST", url + "/v1/completions", json=body, headers=KEY) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            counter[0] += 1
            if counter[0] >= 8:
                started.set()
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk["choices"]:
                finish = choice["finish_reason"] or finish
    return {"usage": usage, "finish": finish}


def test_sigterm_drains_in_flight_and_exits_zero(tiny_dir):
    proc, url = start_subprocess("--model", tiny_dir, "--kv-cache-memory", "16MiB", "--drain-timeout", "60",
                                 "--max-num-seqs", "4", env={"ITERSERVE_API_KEY": "env-key-for-the-tests"})
    try:
        assert httpx.get(url + "/v1/models").status_code == 401  # the key came from the env
        assert httpx.get(url + "/v1/models", headers=KEY).status_code == 200

        async def main():
            started, counter = asyncio.Event(), [0]
            async with httpx.AsyncClient(timeout=120) as client:
                tasks = [asyncio.create_task(_stream(client, url, started, counter)) for _ in range(6)]
                await started.wait()
                proc.send_signal(signal.SIGTERM)
                t0 = time.monotonic()
                while (await client.get(url + "/ready")).status_code != 503:
                    assert time.monotonic() - t0 < 2, "readiness did not fail at once"
                    await asyncio.sleep(0.01)
                late = await client.post(url + "/v1/completions", json={"prompt": [1], "max_tokens": 2},
                                         headers=KEY)
                assert late.status_code == 503
                assert all(not t.done() for t in tasks), "the test needs requests still in flight"
                return await asyncio.gather(*tasks)

        results = asyncio.run(main())
        for r in results:
            assert r["finish"] == "length" and r["usage"]["completion_tokens"] == 300
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        out = proc.communicate()[0]
    assert "Traceback" not in out, out


def test_sigterm_closes_keep_alive_connections_idle_at_once_busy_after_their_response(tiny_dir):
    """Behind a Service, a client's pooled connection to a pod that is going away would carry its next
    request there (and get a 503): the drain closes them, so the next request opens a new connection."""
    # an idle connection would otherwise close only after a minute (the keep-alive timeout): the socket's
    # 20 s timeout fails the test instead
    proc, url = start_subprocess("--model", tiny_dir, "--kv-cache-memory", "16MiB", "--drain-timeout", "60",
                                 "--keep-alive-timeout", "60")
    host, port = url.removeprefix("http://").split(":")
    try:
        idle = http.client.HTTPConnection(host, int(port), timeout=20)
        idle.request("GET", "/health")
        assert idle.getresponse().read() and idle.sock is not None  # kept alive
        busy = http.client.HTTPConnection(host, int(port), timeout=20)
        busy.request("POST", "/v1/completions", headers={"Content-Type": "application/json"},
                     body=json.dumps({"prompt": [5, 6, 7], "max_tokens": 400, "ignore_eos": True, "stream": True}))
        stream = busy.getresponse()
        assert stream.status == 200 and stream.readline().startswith(b"data: ")
        proc.send_signal(signal.SIGTERM)
        assert idle.sock.recv(1) == b""  # closed by the server (a timeout would raise)
        rest = stream.read()  # the stream still completes ...
        assert rest.rstrip().endswith(b"data: [DONE]") and rest.count(b"data: ") > 10
        assert busy.sock.recv(1) == b""  # ... and then its connection closes
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def test_bad_flag_exits_2(tiny_dir):
    r = subprocess.run([sys.executable, "-m", "iterserve.server.entrypoints.cli", "serve", "--model", tiny_dir,
                        "--max-queue", "0"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "max_queue" in r.stderr
