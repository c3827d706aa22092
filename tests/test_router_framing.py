"""The router's own HTTP/1.1 to the pods (router/upstream.py): where a response body ends, however the
pod's bytes are split into reads, and bodies relayed whole through the real `iterserve router`: large
and read slowly by the client (the pod's reads pause and resume), an HTTP/1.0 client, a body delimited
by the pod closing its connection, and a pod's response head split over many reads.

The pod is a STAND-IN, a raw asyncio server in a thread of this test: it sends exactly the bytes each
case needs, which a model server would not.
"""

from __future__ import annotations

import asyncio
import hashlib
import socket
import threading

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.router_overhead import next_request
from iterserve.router.upstream import Head, _Body
from tests.router_support import ThreadedPod, start_router, stop, wait_healthy


def _chunked(pieces: list[bytes], extensions: bool, trailer: bool) -> bytes:
    wire = b"".join(b"%x%s\r\n%s\r\n" % (len(p), b";ext=1" if extensions else b"", p) for p in pieces)
    return wire + b"0\r\n" + (b"x-trailer: 1\r\n" if trailer else b"") + b"\r\n"


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(st.binary(min_size=1, max_size=300), max_size=6), extensions=st.booleans(),
       trailer=st.booleans(), cuts=st.lists(st.integers(min_value=1, max_value=64), min_size=1, max_size=50))
def test_a_chunked_body_decodes_whole_however_it_is_split(pieces, extensions, trailer, cuts):
    wire = _chunked(pieces, extensions, trailer)
    body = _Body(Head(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked", "POST"))
    got, pos, whole = [], 0, False
    for i in range(len(wire)):
        step = cuts[i % len(cuts)]
        piece, whole = body.feed(wire[pos:pos + step])
        got.append(piece)
        pos += step
        if whole:
            break
    assert whole and b"".join(got) == b"".join(pieces)
    assert pos >= len(wire), "it ended before the last chunk's end"


@pytest.mark.parametrize(("head", "method", "length", "chunked", "keep_alive"), [
    (b"HTTP/1.1 200 OK\r\ncontent-length: 12", "POST", 12, False, True),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\ncontent-length: 12", "POST", None, True, True),
    (b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\nconnection: close", "POST", 3, False, False),
    (b"HTTP/1.1 200 OK", "POST", None, False, False),  # the body runs until the pod closes
    (b"HTTP/1.0 200 OK\r\ncontent-length: 3", "POST", 3, False, False),
    (b"HTTP/1.0 200 OK\r\ncontent-length: 3\r\nConnection: Keep-Alive", "POST", 3, False, True),
    (b"HTTP/1.1 204 No Content", "POST", 0, False, True),
    (b"HTTP/1.1 200 OK\r\ncontent-length: 12", "HEAD", 0, False, True),
])
def test_a_response_head_says_where_its_body_ends(head, method, length, chunked, keep_alive):
    h = Head(head, method)
    assert (h.length, h.chunked, h.keep_alive) == (length, chunked, keep_alive)


@pytest.mark.parametrize("head", [b"SSH-2.0-OpenSSH", b"HTTP/1.1 OK", b"HTTP/1.1 200 OK\r\nno colon here"])
def test_what_is_not_an_http_head_is_refused(head):
    with pytest.raises(ValueError):
        Head(head, "POST")


class RawPod(ThreadedPod):
    """Answers /metrics with idle gauges; a POST with `answer(request_head)`: a list of byte strings, each
    written on its own after a short pause (so that the router reads them apart). `close_after`: the
    connection is closed once they are written."""

    def __init__(self, answer, close_after: bool = False) -> None:
        super().__init__()
        self.answer, self.close_after = answer, close_after

    async def _handle(self, reader, writer) -> None:
        try:
            while True:
                head = await next_request(reader, writer)
                for part in self.answer(head):
                    writer.write(part)
                    await writer.drain()
                    await asyncio.sleep(0.002)
                if self.close_after:
                    writer.close()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()


BIG = bytes(range(256)) * 4096 * 8  # 8 MiB: far above what the router queues for a client before it pauses


def _big_chunked(head: bytes) -> list[bytes]:
    pieces = [BIG[i:i + 65536] for i in range(0, len(BIG), 65536)]
    return [b"HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\ntransfer-encoding: chunked\r\n\r\n",
            _chunked(pieces, False, False)]


def test_a_large_body_read_slowly_arrives_whole():
    with RawPod(_big_chunked) as pod:
        proc, router = start_router(pod.url)
        try:
            wait_healthy(router, pod.url)
            digest, size = hashlib.sha256(), 0
            with httpx.stream("POST", router + "/v1/completions", json={"prompt": "x"}, timeout=60) as r:
                assert r.status_code == 200
                for i, data in enumerate(r.iter_raw(65536)):
                    digest.update(data)
                    size += len(data)
                    if i < 40:  # slow at first, so that the router's buffer for this client fills
                        threading.Event().wait(0.02)
            assert size == len(BIG) and digest.digest() == hashlib.sha256(BIG).digest()
            r = httpx.post(router + "/v1/completions", json={"prompt": "again"}, timeout=60)  # the same connection
            assert r.status_code == 200 and r.content == BIG
        finally:
            out = stop(proc)
    assert "Traceback" not in out, out


def _raw_exchange(router: str, request: bytes) -> bytes:
    host, port = router.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(request)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return data


def test_an_http10_client_gets_the_stream_unframed_and_the_connection_closed():
    events = [b"data: one\n\n", b"data: two\n\n", b"data: [DONE]\n\n"]

    def answer(head):
        return [b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n",
                *(b"%x\r\n%s\r\n" % (len(e), e) for e in events), b"0\r\n\r\n"]

    with RawPod(answer) as pod:
        proc, router = start_router(pod.url)
        try:
            wait_healthy(router, pod.url)
            body = b'{"prompt": "x", "stream": true}'
            data = _raw_exchange(router, b"POST /v1/completions HTTP/1.0\r\ncontent-type: application/json\r\n"
                                         b"content-length: %d\r\n\r\n%s" % (len(body), body))
            head, _, payload = data.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.0 200") and b"transfer-encoding" not in head.lower(), head
            assert payload == b"".join(events)  # the router's socket closed after it: recv returned b""
        finally:
            out = stop(proc)
    assert "Traceback" not in out, out


def test_a_body_the_pod_ends_by_closing_and_a_head_split_over_reads():
    def answer(head):
        text = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\nconnection: close\r\n\r\nall of it, up to the close"
        return [text[i:i + 7] for i in range(0, len(text), 7)]

    with RawPod(answer, close_after=True) as pod:
        proc, router = start_router(pod.url)
        try:
            wait_healthy(router, pod.url)
            for _ in range(2):  # the second on a new connection to the pod: the first was not pooled
                r = httpx.post(router + "/v1/completions", json={"prompt": "x"}, timeout=10)
                assert (r.status_code, r.text) == (200, "all of it, up to the close")
        finally:
            out = stop(proc)
    assert "Traceback" not in out, out
