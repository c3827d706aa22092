"""The probes that found issue 26, against `iterserve serve` on the bundled model with an API key, an admin
token and `--max-queue 8`: secrets that are too short or shared stop the server at start; a request as
large as the server allows is taken in while /health goes on answering; a request with many prompts
neither overfills the queue nor locks other clients out; a lone surrogate is a 400, not a 500.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.server_support import ROOT, metric_value, start_subprocess

KEY = "api-key-0123456789abcdef"
ADMIN = "admin-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_BYTES = 4 * 2**20  # the default --max-request-bytes


def serve_exit(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("ITERSERVE_API_KEY", "ITERSERVE_ADMIN_TOKEN")}
    return subprocess.run([sys.executable, "-m", "iterserve.server.entrypoints.cli", "serve", *args],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, env={**base, **(env or {})})


@pytest.mark.parametrize("args, env, named", [
    (("--api-key", "k1", "--admin-token", "a1", "--max-queue", "8"), None, "--api-key"),  # the command
    (("--api-key", KEY, "--admin-token", "a1"), None, "--admin-token"),
    (("--api-key", KEY, "--admin-token", KEY), None, "--admin-token"),  # one secret for both
    ((), {"ITERSERVE_API_KEY": "short"}, "ITERSERVE_API_KEY"),
])
def test_weak_secrets_stop_the_server_at_start(args, env, named):
    r = serve_exit(*args, env=env)
    assert r.returncode == 2, r.stderr
    assert named in r.stderr and "Traceback" not in r.stderr


@pytest.fixture(scope="module")
def server():
    proc, url = start_subprocess("--api-key", KEY, "--admin-token", ADMIN, "--max-queue", "8",
                                 "--kv-cache-memory", "128MiB", "--max-model-len", "1024")
    yield url
    proc.terminate()
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, out
    assert "Traceback" not in out, out


class HealthProber(threading.Thread):
    """GET /health back to back on one connection, recording when each was sent and answered."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.probes, self.stop = url, [], threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=60) as client:
            while not self.stop.is_set():
                sent = time.monotonic()
                status = client.get(self.url + "/health").status_code
                self.probes.append((sent, time.monotonic(), status))

    def __enter__(self) -> HealthProber:
        self.start()
        while not self.probes:
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.join(60)
        assert all(status == 200 for _, _, status in self.probes)


def exchange(url: str, body: bytes, send_body: bool = True) -> tuple[float, float, int, dict]:
    """One request on a raw connection -> (when its last byte was sent, when its answer came, status,
    JSON body). Without `send_body` only the head goes out: a body the server refuses by its length
    is not read, and the server closes the connection rather than take in the rest."""
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=120) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
                     .encode() + (body if send_body else b""))
        sent = time.monotonic()
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
        answered = time.monotonic()
    head, _, payload = answer.partition(b"\r\n\r\n")
    return sent, answered, int(head.split()[1]), json.loads(payload)


def test_health_answers_while_the_largest_request_is_taken_in(server):
    # a prompt as large as the body limit allows: taking it in (tokenizing ~4 MB) held the event loop
    # for seconds. Now it runs in a worker thread: many health probes are sent and answered after the
    # whole request is sent and before its answer, none of them slow (the target is 100 ms; old code
    # answered none in that window)
    body = json.dumps({"prompt": "health check " * ((MAX_BYTES - 100) // 13), "max_tokens": 4}).encode()
    assert MAX_BYTES - 200 < len(body) <= MAX_BYTES
    with HealthProber(server) as prober:
        sent, answered, status, payload = exchange(server, body)
    assert status == 400 and payload["error"]["code"] == "context_length_exceeded", payload
    during = [(s, a) for s, a, _ in prober.probes if sent <= s and a <= answered]
    assert len(during) >= 10, (len(during), answered - sent)
    assert max(a - s for s, a, _ in prober.probes) < 1.0


def test_stop_token_ids_with_many_choices_are_bounded(server):
    # the probe: 7.9 MB of stop_token_ids with n=128 stalled /health for 8 s
    def body(size: int) -> bytes:
        return json.dumps({"prompt": "x", "n": 128, "max_tokens": 1,
                           "stop_token_ids": [123456] * (size // 8)}).encode()

    with HealthProber(server) as prober:
        _, _, status, payload = exchange(server, body(7_900_000), send_body=False)
        assert status == 413 and payload["error"]["code"] == "request_too_large"
        _, _, status, payload = exchange(server, body(MAX_BYTES - 100))
        assert status == 400 and payload["error"]["param"] == "stop_token_ids"
    assert max(a - s for s, a, _ in prober.probes) < 1.0


def test_many_prompts_neither_overfill_the_queue_nor_lock_others_out(server):
    # the probes: 300 prompts put 108 sequences in a queue limited to 8; 1,024 prompts got every
    # other client a 429 while they ran. Now both are refused at once, and others are served
    for count in (300, 1024):
        r = httpx.post(server + "/v1/completions", headers=AUTH, timeout=60,
                       json={"prompt": [f"Prompt {i}" for i in range(count)], "max_tokens": 64})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        assert "--max-queue 8" in r.json()["error"]["message"]
        other = httpx.post(server + "/v1/chat/completions", headers=AUTH, timeout=120,
                           json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
        assert other.status_code == 200, other.text
    assert metric_value(httpx.get(server + "/metrics").text, "vllm:num_requests_waiting") == 0


def test_a_lone_surrogate_is_a_400_naming_the_field(server):
    for path, raw, param in (
            ("/v1/completions", b'{"prompt": "hi \\ud800", "max_tokens": 4}', "prompt"),
            ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi \\ud800"}]}',
             "messages[0].content")):
        r = httpx.post(server + path, content=raw, headers={**AUTH, "content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    text = httpx.get(server + "/metrics").text
    assert 'code="500"' not in text
    assert metric_value(text, "iterserve:http_responses_total", route="/v1/completions", code="400") >= 1
