"""Slow clients: a request head or body that never finishes, and a streaming client that stops reading.
Each is cut off (the connection closed, the body answered with 408, the stream's choices aborted and their
KV blocks freed) and counted in `iterserve:client_cutoffs_total`. The timeouts are short here; what is
asserted is that the cut happened and what it freed, never how soon.
"""

from __future__ import annotations

import json
import socket
import time

import pytest

from iterserve.server.api.limits import ServerLimits
from tests.conftest import TINY, save_tiny
from tests.server_support import InProcessServer, add_tiny_tokenizer, metric_value, wait_idle

MODEL = "test-model"


@pytest.fixture(scope="module")
def long_tiny_dir(tmp_path_factory):
    """The tiny random Llama with a 4096-token context, so a stream can outlast the socket buffers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-long")
    save_tiny(LlamaForCausalLM, LlamaConfig(**{**TINY, "max_position_embeddings": 4096}), path)
    return add_tiny_tokenizer(str(path), tmp_path_factory.mktemp("tiny-long-tok"))


@pytest.fixture(scope="module")
def server(long_tiny_dir):
    limits = ServerLimits(header_timeout=1, body_timeout=1, keep_alive_timeout=60)
    with InProcessServer(long_tiny_dir, model_name=MODEL, limits=limits) as srv:
        yield srv


def scrape(srv) -> str:
    return srv.state.metrics.render(False).decode()


def cutoffs(srv, reason: str) -> float:
    return metric_value(scrape(srv), "iterserve:client_cutoffs_total", reason=reason)


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a server that never does fails the
    test by the socket's timeout)."""
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except ConnectionResetError:
        pass
    return received


def connect(srv, timeout: float = 60) -> socket.socket:
    return socket.create_connection(("127.0.0.1", srv.port), timeout=timeout)


@pytest.mark.parametrize("sent", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Ty"])
def test_a_head_that_never_ends_is_closed(server, sent):
    before = cutoffs(server, "header_timeout")
    with connect(server) as sock:
        sock.sendall(sent)
        assert read_until_closed(sock) == b""
    assert cutoffs(server, "header_timeout") == before + 1


def test_a_kept_alive_connection_must_finish_its_next_head(server):
    before = cutoffs(server, "header_timeout")
    with connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        first = b""
        while not first.endswith(b'{"status":"ok"}'):
            first += sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET /hea")  # the keep-alive timeout (60 s) is not what closes this
        assert read_until_closed(sock) == b""
    assert cutoffs(server, "header_timeout") == before + 1


def test_an_idle_kept_alive_connection_is_closed_after_the_keep_alive_timeout(long_tiny_dir):
    # the default is long (75 s: longer than a proxy's idle pool), but an idle connection still closes;
    # the head timeout is longer here, so only the keep-alive timeout can close it
    limits = ServerLimits(header_timeout=600, keep_alive_timeout=1)
    with InProcessServer(long_tiny_dir, model_name=MODEL, limits=limits) as srv, connect(srv) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        answer = read_until_closed(sock)
        assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b'{"status":"ok"}'), answer


def test_a_body_that_never_ends_gets_408(server):
    before = cutoffs(server, "body_timeout")
    with connect(server) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"prompt\": \"")
        answer = read_until_closed(sock)
    status_line, _, rest = answer.partition(b"\r\n")
    assert status_line.split()[1] == b"408", answer
    error = json.loads(rest.partition(b"\r\n\r\n")[2])["error"]
    assert error["code"] == "request_timeout" and "--body-timeout" in error["message"]
    assert cutoffs(server, "body_timeout") == before + 1
    assert metric_value(scrape(server), "iterserve:http_responses_total", route="/v1/completions", code="408") >= 1


class _PacedRunner:
    """The real model runner, one step per `period` seconds at the most: the pace of a larger model, so
    that a 2000-token stream cannot end within a few seconds on any machine."""

    def __init__(self, runner, period: float):
        self.runner, self.period = runner, period

    def execute_model(self, out):
        time.sleep(self.period)
        return self.runner.execute_model(out)

    def __getattr__(self, name):
        return getattr(self.runner, name)


STREAM = {"model": MODEL, "prompt": "never read", "n": 8, "max_tokens": 2000, "ignore_eos": True,
          "logprobs": 20, "stream": True}  # logprobs make each chunk large, so the socket buffers fill early


def run_non_reader(srv, reason: str) -> None:
    """The issue's probe: an n=8 stream whose client never reads. Waits until it is cut off for
    `reason`, then checks that its choices were aborted and all KV blocks came back."""
    before = scrape(srv)
    aborted = metric_value(before, "vllm:request_success_total", finished_reason="abort")
    generated = metric_value(before, "vllm:generation_tokens_total")
    body = json.dumps(STREAM).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
    sock.settimeout(60)
    sock.connect(("127.0.0.1", srv.port))
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 240
        while cutoffs(srv, reason) < 1:
            assert time.monotonic() < deadline, f"never cut off ({reason})"
            assert srv.engine.snapshot()["num_generated_tokens"] < 8 * STREAM["max_tokens"], "the stream ran to its end"
            time.sleep(0.1)
        text = wait_idle(srv.url)
        assert metric_value(text, "vllm:request_success_total", finished_reason="abort") == aborted + 8
        assert metric_value(text, "vllm:generation_tokens_total") - generated < 8 * STREAM["max_tokens"]
        assert srv.state.engine.num_in_flight == 0
    finally:
        sock.close()




def test_a_client_that_stops_reading_is_cut_off_after_the_stall_timeout(long_tiny_dir):
    limits = ServerLimits(stall_timeout=1, max_buffered_tokens=10**6)  # only the timeout can act
    with InProcessServer(long_tiny_dir, model_name=MODEL, limits=limits, kv_cache_memory="16MiB",
                         core_in_process=True) as srv:  # the engine core in reach, to pace its runner
        srv.core.model_runner = _PacedRunner(srv.core.model_runner, period=0.01)
        run_non_reader(srv, "stall_timeout")
        assert cutoffs(srv, "reader_behind") == 0


def test_a_reader_that_falls_behind_has_its_stream_aborted(long_tiny_dir):
    # the bounded buffer: once the socket is full, the server keeps at most 64 tokens of a choice for
    # a reader that takes none; then it aborts, however fast or slow the engine runs
    limits = ServerLimits(stall_timeout=600, max_buffered_tokens=64)
    with InProcessServer(long_tiny_dir, model_name=MODEL, limits=limits, kv_cache_memory="16MiB") as srv:
        run_non_reader(srv, "reader_behind")
        assert cutoffs(srv, "stall_timeout") == 0
