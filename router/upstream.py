"""The router's connections to the pods: HTTP/1.1 on asyncio protocols, kept alive in a pool per pod.

A relayed response body goes from the pod's socket callback (`data_received`) straight to the client's
socket, in the same callback: no stream reader, no task to wake per chunk. aiohttp's client, which the
router used before, took a third of the router's CPU time per request in `ClientSession._request`, and
woke the handler's task for each chunk it read; at 100 streams the handlers' wake-ups queued behind one
another on the single event loop, and that queue was the latency the router added.

The framing is decoded here (content-length, chunked, or until close), so the connection knows where a
response ends and can go back to the pool; the handler (router/proxy.py) frames the body again for the
client as aiohttp announced it. What is sent to the pod is one write: the head and the body.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

HEAD_LIMIT = 64 * 1024  # a pod's response head larger than this is not a pod's
_SIZE, _DATA, _CRLF, _TRAILER = range(4)  # where a chunked body's parser stands
_NO_BODY = {204, 304}


class UpstreamError(Exception):
    """The pod's connection failed (before the response head or after: the handler knows which it awaited)."""


class Head:
    __slots__ = ("status", "reason", "headers", "length", "chunked", "keep_alive")

    def __init__(self, raw: bytes, method: str) -> None:
        lines = raw.split(b"\r\n")
        version, _, rest = lines[0].partition(b" ")
        code, _, reason = rest.partition(b" ")
        if not version.startswith(b"HTTP/1.") or not code.isdigit():
            raise ValueError(f"not an HTTP/1.x status line: {lines[0][:100]!r}")
        self.status, self.reason = int(code), reason.decode("latin-1")
        self.headers: list[tuple[bytes, bytes]] = []
        length, chunked, connection = None, False, b""
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep:
                raise ValueError(f"a header line without a colon: {line[:100]!r}")
            name, value = name.strip().lower(), value.strip()
            self.headers.append((name, value))
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding":
                chunked = value.lower().endswith(b"chunked")
            elif name == b"connection":
                connection = value.lower()
        if method == "HEAD" or self.status in _NO_BODY or 100 <= self.status < 200:
            length, chunked = 0, False
        self.length = None if chunked else length  # chunked wins over a content-length (RFC 9112 6.3)
        self.chunked = chunked
        http10 = version == b"HTTP/1.0"
        self.keep_alive = (b"keep-alive" in connection) if http10 else (b"close" not in connection)
        if not chunked and length is None:  # the body runs until the pod closes the connection
            self.keep_alive = False


class _Body:
    """Where a body ends: `feed` gives the payload in `data` and whether the body is complete.

    Chunked framing is parsed by offsets into the bytes received (a pod's SSE event is usually one chunk in
    one read: one slice, no copy of what surrounds it); only an incomplete tail is kept for the next read."""

    __slots__ = ("remaining", "chunked", "tail", "state", "need")

    def __init__(self, head: Head) -> None:
        self.remaining, self.chunked = head.length, head.chunked
        self.tail = b""
        self.state, self.need = _SIZE, 0

    def feed(self, data: bytes) -> tuple[bytes, bool]:
        if not self.chunked:
            if self.remaining is None:  # until close
                return data, False
            take = data[: self.remaining]
            self.remaining -= len(take)
            return take, self.remaining == 0
        if self.tail:
            data, self.tail = self.tail + data, b""
        out: list[bytes] = []
        pos, n, state, need = 0, len(data), self.state, self.need
        while pos < n:
            if state == _DATA:
                end = min(n, pos + need)
                out.append(data[pos:end])
                need -= end - pos
                pos = end
                if not need:
                    state = _CRLF
            elif state == _CRLF:
                if n - pos < 2:
                    break
                pos += 2
                state = _SIZE
            elif state == _SIZE:
                end = data.find(b"\r\n", pos)
                if end < 0:
                    if n - pos > 1024:
                        raise ValueError("a chunk-size line over 1 KiB")
                    break
                need = int(data[pos:end].split(b";", 1)[0], 16)
                pos = end + 2
                state = _DATA if need else _TRAILER
            else:  # after the last chunk: trailer lines, then an empty one
                if data.startswith(b"\r\n", pos) or data.find(b"\r\n\r\n", pos) >= 0:
                    return b"".join(out), True
                break
        self.state, self.need, self.tail = state, need, data[pos:]
        return (out[0] if len(out) == 1 else b"".join(out)), False


class Connection(asyncio.Protocol):
    """One kept-alive connection to a pod, carrying one request at a time.

    `send` writes a request; `head` is awaited for the response head; then `relay(sink)` hands every piece
    of the body to `sink` as it arrives (the pieces that came before it first), and `done` resolves once the
    body is whole (the connection is idle again) or fails with UpstreamError."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.idle_since = time.monotonic()
        self.closed = False
        self._method = "GET"
        self._buf = bytearray()
        self._head: asyncio.Future[Head] | None = None
        self._done: asyncio.Future[None] | None = None
        self._body: _Body | None = None
        self._sink: Callable[[bytes], None] | None = None
        self._early: list[bytes] = []
        self.reusable = False

    # asyncio.Protocol
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self._done is None or self._done.done():  # bytes with no request out: not a connection to reuse
            self.close()
            return
        try:
            if self._body is None:
                self._read_head(data)
            else:
                self._read_body(data)
        except ValueError as e:
            self._fail(UpstreamError(f"the pod's response is not HTTP/1.1: {e}"))

    def eof_received(self) -> bool:
        return False  # the connection closes; connection_lost says what that means

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._body is not None and self._body.remaining is None and not self._body.chunked \
                and self._done is not None and not self._done.done():
            self._done.set_result(None)  # a body delimited by the close: whole now
            return
        self._fail(UpstreamError("the pod closed the connection" + (f" ({exc!r})" if exc else "")))

    # the handler's side
    def send(self, data: bytes, method: str) -> None:
        loop = asyncio.get_running_loop()
        self.reusable = False
        self._method = method
        self._head, self._done = loop.create_future(), loop.create_future()
        self._body, self._sink, self._early = None, None, []
        assert self.transport is not None
        self.transport.write(data)

    async def head(self) -> Head:
        assert self._head is not None
        return await self._head

    def relay(self, sink: Callable[[bytes], None]) -> None:
        """From now on every piece of the body goes to `sink`, those that arrived before first."""
        early, self._early = self._early, []
        self._sink = sink
        for piece in early:
            sink(piece)

    def take_early(self) -> bytes:
        """The body received so far and not yet relayed."""
        early, self._early = self._early, []
        return b"".join(early)

    def whole(self) -> bool:
        """The response has arrived whole (and every piece of it has been relayed or taken)."""
        return self._done is not None and self._done.done() and self._done.exception() is None

    async def done(self) -> None:
        assert self._done is not None
        await self._done

    def pause(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def close(self) -> None:
        """Closed mid-request: the pod sees the client leave, and aborts the request."""
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    # internals
    def _read_head(self, data: bytes) -> None:
        self._buf += data
        end = self._buf.find(b"\r\n\r\n")
        if end < 0:
            if len(self._buf) > HEAD_LIMIT:
                raise ValueError(f"no end of the response head within {HEAD_LIMIT} bytes")
            return
        head = Head(bytes(self._buf[:end]), self._method)
        rest = bytes(self._buf[end + 4:])
        self._buf.clear()
        if 100 <= head.status < 200:  # 1xx (the router sends no Expect, so hardly ever): the real head follows
            if rest:
                self._read_head(rest)
            return
        self._body = _Body(head)
        if self._head is not None and not self._head.done():
            self._head.set_result(head)
        if rest or head.length == 0:
            self._read_body(rest)

    def _read_body(self, data: bytes) -> None:
        assert self._body is not None
        piece, whole = self._body.feed(data)
        if piece:
            if self._sink is not None:
                self._sink(piece)
            else:
                self._early.append(piece)
        if whole and self._done is not None and not self._done.done():
            self.reusable = self._head is not None and self._head.done() and self._head.result().keep_alive
            self._body = None
            self.idle_since = time.monotonic()
            self._done.set_result(None)

    def _fail(self, error: UpstreamError) -> None:
        self.closed = True
        for fut in (self._head, self._done):
            if fut is not None and not fut.done():
                fut.set_exception(error)
                fut.exception()  # retrieved here: the handler may be awaiting only one of the two
        if self.transport is not None:
            self.transport.close()


class Pool:
    """Idle connections per pod, the most recently used first; one idle longer than `idle_timeout` is closed."""

    def __init__(self, idle_timeout: float, connect_timeout: float) -> None:
        self.idle_timeout, self.connect_timeout = idle_timeout, connect_timeout
        self._idle: dict[tuple[str, int], list[Connection]] = {}
        self._sweeper: asyncio.Task | None = None

    def start(self) -> None:
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep())

    async def acquire(self, host: str, port: int) -> tuple[Connection, bool]:
        """A connection to host:port, and whether it was opened now (OSError, TimeoutError when it fails)."""
        idle = self._idle.get((host, port))
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < self.idle_timeout:
                return conn, False
            conn.close()
        loop = asyncio.get_running_loop()
        _, conn = await asyncio.wait_for(loop.create_connection(Connection, host, port), self.connect_timeout)
        return conn, True

    def release(self, host: str, port: int, conn: Connection) -> None:
        if conn.reusable and not conn.closed:
            self._idle.setdefault((host, port), []).append(conn)
        else:
            conn.close()

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(max(1.0, self.idle_timeout / 4))
            now = time.monotonic()
            for idle in self._idle.values():
                keep = [c for c in idle if not c.closed and now - c.idle_since < self.idle_timeout]
                for conn in idle:
                    if conn not in keep:
                        conn.close()
                idle[:] = keep

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
