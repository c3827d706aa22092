"""The router's request handler: picks a pod for each request and relays it, streaming as it arrives.

It is an aiohttp low-level handler (router/serve.py runs the server): aiohttp's C HTTP parser reads the
request, the handler sees the raw body, the path and the headers. The pod's side is the router's own
(router/upstream.py): the request goes out in one write on a pooled connection, the response head comes
back to the handler, which starts the client's response through aiohttp, and from then on each piece of
the body goes from the pod's socket callback straight to the client's socket, framed as aiohttp announced.
`/v1/completions` and `/v1/chat/completions` are routed by the policy on their prompt; the other API
routes (`/v1/models`, `/tokenize`, ...) go to the least loaded pod. The router answers `/health` (it
runs), `/ready` (some pod is routable) and `/metrics` (its own) itself.

Failures: a pod that refuses the connection is marked down and the request goes to another pod; so does
one that drops the connection before its response head, or answers 503 `draining` (nothing was started
there). A pooled connection that the pod closed as the request went out on it is not a failed pod: the
request goes again to the same pod on another connection. A pod's own answers, errors included, pass
through unchanged. Once the response has started, a pod that fails cuts the client's connection too, so
a client never takes a truncated stream for a whole one. A client that disconnects cancels its handler
(the server runs with handler cancellation), which closes the pod's connection and so aborts the request
there.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from aiohttp import HttpVersion11, web

from iterserve.router.metrics import RouterMetrics
from iterserve.router.pods import PodSet
from iterserve.router.policy import LeastLoad, estimated_tokens
from iterserve.router.prefix_key import routing_key
from iterserve.router.upstream import Connection, Head, Pool, UpstreamError

logger = logging.getLogger("iterserve.router")
KEYED_ROUTES = ("/v1/completions", "/v1/chat/completions")
OTHER_ROUTES = ("/tokenize", "/detokenize", "/version")
# hop-by-hop headers (RFC 9110 7.6.1) and those the next hop sets itself
# (expect: the router sends the body with the head, so a pod's 100 Continue would only be in the way)
_DROP_REQUEST = {b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer", b"transfer-encoding",
                 b"upgrade", b"host", b"content-length", b"expect"}
# the body is framed again for the client, as aiohttp announces it (content-length or chunked)
_DROP_RESPONSE = {b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"date", b"server"}
_HIGH_WATER, _LOW_WATER = 1 << 20, 1 << 18  # bytes queued for a slow client: stop reading the pod, and resume
_JSON = "application/json"


class _Cut(Exception):
    """The relay stopped midway (the pod failed, or the client left): `answer`, the response already
    started, whose connection is closing; aiohttp can write nothing more on it."""

    def __init__(self, answer: web.StreamResponse) -> None:
        super().__init__()
        self.answer = answer


def _error(status: int, message: str, code: str) -> web.Response:
    kind = "service_unavailable" if status == 503 else "invalid_request_error"
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}})
    return web.Response(status=status, text=body, content_type=_JSON)


def _draining(body: bytes) -> bool:
    try:
        return json.loads(body)["error"]["code"] == "draining"
    except (ValueError, KeyError, TypeError):
        return False


class Router:
    def __init__(self, pods: PodSet, policy_name: str, policy, *, prefix_chars: int = 256,
                 connect_timeout: float = 2.0, idle_timeout: float = 60.0, max_request_bytes: int = 32 * 2**20,
                 max_retries: int = 3) -> None:
        self.pods, self.policy_name, self.policy = pods, policy_name, policy
        self.idle_timeout = idle_timeout
        self.keyed = policy_name == "prefix-hash"  # least-load never reads the body
        self.prefix_chars, self.max_request_bytes, self.max_retries = prefix_chars, max_request_bytes, max_retries
        self.any_pod = LeastLoad()
        self.metrics = RouterMetrics(pods)
        # idle connections to the pods are kept `idle_timeout` s, across the gaps of ordinary traffic: a burst
        # after a lull then finds them open instead of paying a connect each. The pods keep theirs longer
        # (`iterserve serve --keep-alive-timeout`, 75 s), so the router, not the pod, closes an idle one;
        # a pod that closes one as it is reused anyway (another server, a shorter setting) costs a retry.
        # No read timeout: a long generation streams for minutes.
        self.pool = Pool(idle_timeout, connect_timeout)

    async def start(self) -> None:
        """In the running loop: the pods' first scrape, then the pool's sweeper."""
        await self.pods.start()
        self.pool.start()

    async def stop(self) -> None:
        await self.pods.stop()
        await self.pool.close()

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        path = request.path
        if path in KEYED_ROUTES or path.startswith("/v1/") or path in OTHER_ROUTES:
            return await self._proxy(request, keyed=self.keyed and path in KEYED_ROUTES)
        if path == "/health":
            return web.json_response({"status": "ok", "pods": len(self.pods.pods),
                                      "healthy": len(self.pods.healthy())})
        if path == "/ready":
            if self.pods.healthy():
                return web.Response(text='{"status": "ready"}', content_type=_JSON)
            return _error(503, "no pod is routable", "no_pods")
        if path == "/metrics":
            return web.Response(body=self.metrics.render(),
                                headers={"content-type": "text/plain; version=0.0.4; charset=utf-8"})
        return _error(404, f"no route {path}", "not_found")

    async def _read_body(self, request: web.BaseRequest) -> bytes | None:
        chunks, size = [], 0
        async for chunk in request.content.iter_any():  # a small body is one chunk, already read
            size += len(chunk)
            if size > self.max_request_bytes:
                return None
            chunks.append(chunk)
        return b"".join(chunks)

    async def _proxy(self, request: web.BaseRequest, keyed: bool) -> web.StreamResponse:
        arrived = time.perf_counter()
        body = await self._read_body(request)
        if body is None:
            self.metrics.requests.labels("none", "413").inc()
            return _error(413, f"the request body exceeds {self.max_request_bytes} bytes", "request_too_large")
        key = routing_key(body, self.prefix_chars) if keyed else None
        # the request as it goes to a pod, but for its host line: one write with the body
        head = b"%s %s HTTP/1.1\r\n" % (request.method.encode(), request.raw_path.encode("utf-8", "surrogateescape"))
        headers = b"".join(b"%s: %s\r\n" % (k, v) for k, v in request.raw_headers if k.lower() not in _DROP_REQUEST)
        headers += b"content-length: %d\r\n\r\n" % len(body)
        try:
            return await self._route(request, head, headers, body, key, arrived)
        except _Cut as cut:
            return cut.answer

    async def _route(self, request, head, headers, body, key, arrived) -> web.StreamResponse:
        tried: set[str] = set()
        # prefix-hash without a key (nothing to hash) takes the least loaded pod; the others pick as always
        policy = self.any_pod if self.keyed and key is None else self.policy
        while True:
            candidates = [p.load for p in self.pods.healthy(exclude=tried)]
            if not candidates or len(tried) > self.max_retries:
                self.metrics.requests.labels("none", "503").inc()
                why = "no pod is routable" if not tried else f"{len(tried)} pods failed to take the request"
                return _error(503, why, "no_pods")
            decision = policy.pick(candidates, key)
            outcome = "retry" if tried else ("spilled" if decision.spilled else "primary")
            self.metrics.decisions.labels(self.policy_name, outcome).inc()
            pod = self.pods.pods[decision.pod]
            tried.add(pod.url)
            pod.load.in_flight += 1
            pod.load.unscraped[id(request)] = estimated_tokens(len(body))  # until a scrape counts it, or it ends
            try:
                data = b"%shost: %s:%d\r\n%s%s" % (head, pod.host.encode(), pod.port, headers, body)
                answer = await self._attempt(pod, request, data, arrived)
            finally:
                pod.load.in_flight -= 1
                if pod.load.unscraped.pop(id(request), None) is None:
                    pod.load.ended += 1  # the pod's last scrape counted it: that count is one too high now
            if answer is not None:
                return answer

    async def _attempt(self, pod, request, data: bytes, arrived: float) -> web.StreamResponse | None:
        """One try on `pod`: None when nothing reached the client and another pod may take the request."""
        for _ in range(self.max_retries + 1):
            try:
                conn, opened = await self.pool.acquire(pod.host, pod.port)
            except (OSError, asyncio.TimeoutError) as e:
                self.metrics.upstream_failures.labels(pod.url, "connect").inc()
                self.pods.mark_down(pod, f"connect: {type(e).__name__}")
                return None
            if opened:
                self.metrics.connections.labels(pod.url).inc()
            try:
                conn.send(data, request.method)
                self.metrics.to_upstream.observe(time.perf_counter() - arrived)
                head = await conn.head()
            except UpstreamError as e:
                if opened:
                    self._dropped(pod, e)
                    return None
                # a pooled connection the pod closed while idle, as the request went out (the race every
                # proxy with kept-alive upstreams has): the pod read nothing; again on the same pod, whose
                # load the policy chose it for, on another connection
                self.metrics.upstream_failures.labels(pod.url, "stale_connection").inc()
                continue
            except BaseException:  # the client left (its handler is cancelled): the pod aborts the request
                conn.close()
                raise
            return await self._answer(conn, head, pod, request, arrived)
        return None

    def _dropped(self, pod, e: UpstreamError) -> None:
        """It dropped the connection before answering: nothing was sent on, another pod may take it."""
        self.metrics.upstream_failures.labels(pod.url, "dropped").inc()
        logger.warning("pod %s dropped a request before answering (%s); retrying elsewhere", pod.url, e)

    async def _answer(self, conn: Connection, head: Head, pod, request, arrived: float) -> web.StreamResponse | None:
        """The pod's answer relayed, or None when it is draining (nothing was started there)."""
        whole = False
        try:
            if head.status == 503:  # one small JSON error: is it a draining pod's?
                try:
                    await conn.done()
                except UpstreamError as e:
                    self._dropped(pod, e)
                    return None
                read = conn.take_early()
                if _draining(read):
                    self.metrics.upstream_failures.labels(pod.url, "draining").inc()
                    self.pods.mark_down(pod, "draining")
                    whole = True
                    return None
                answer = await self._relay(conn, head, pod, request, arrived, read)
            else:
                answer = await self._relay(conn, head, pod, request, arrived)
            whole = True
            return answer
        finally:
            # a response cut short (the client left, the pod failed) closes its connection, which the pod
            # reads as a disconnect and aborts the request; a whole one goes back to the pool
            self.pool.release(pod.host, pod.port, conn) if whole else conn.close()

    async def _relay(self, conn: Connection, head: Head, pod, request, arrived: float, first: bytes | None = None
                     ) -> web.StreamResponse:
        """The head through aiohttp, then the body from the pod's socket callback to the client's socket."""
        head_at = time.perf_counter()
        answer = web.StreamResponse(status=head.status, reason=head.reason, headers=[
            (k.decode("latin-1"), v.decode("latin-1")) for k, v in head.headers if k not in _DROP_RESPONSE])
        chunked = head.length is None and request.version >= HttpVersion11
        if head.length is not None:
            answer.content_length = head.length
        elif chunked:
            answer.enable_chunked_encoding()
        # (HTTP/1.0 client, no length: aiohttp sends the body as it comes and closes the connection after it)
        if first is None:
            first = conn.take_early()
        whole = conn.whole()  # (read with the take: what arrives while aiohttp writes goes through the relay)
        # the head leaves with the first body bytes when both are here already, at once when not, so that a
        # client sees a queued request's head before its first token
        answer._send_headers_immediately = not first
        await answer.prepare(request)
        self.metrics.requests.labels(pod.url, str(head.status)).inc()
        if whole:  # a whole response (not streamed): head and body in one write, aiohttp framing it
            await answer.write_eof(first)
        elif first:
            await answer.write(first)
        self.metrics.to_client.observe(time.perf_counter() - head_at)
        if first:
            self.metrics.first_byte.observe(time.perf_counter() - arrived)
        if whole:
            return answer
        transport = request.transport
        loop = asyncio.get_running_loop()
        pending_first = not first

        def resume_when_drained() -> None:
            if conn.closed or transport.is_closing():
                return
            if transport.get_write_buffer_size() > _LOW_WATER:
                loop.call_later(0.005, resume_when_drained)
            else:
                conn.resume()

        def sink(piece: bytes) -> None:  # in the pod connection's data_received: no task wakes per chunk
            nonlocal pending_first
            if transport is None or transport.is_closing():
                conn.close()  # the client left; its handler is being cancelled too
                return
            transport.write(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
            if pending_first:
                self.metrics.first_byte.observe(time.perf_counter() - arrived)
                pending_first = False
            if transport.get_write_buffer_size() > _HIGH_WATER:  # a slow client: hold the pod's bytes back
                conn.pause()
                loop.call_later(0.005, resume_when_drained)

        conn.relay(sink)
        try:
            await conn.done()
        except UpstreamError as e:
            self.metrics.upstream_failures.labels(pod.url, "mid_response").inc()
            logger.warning("pod %s failed mid-response (%s): cutting the client's connection", pod.url, e)
            if transport is not None:
                transport.close()  # before any terminating chunk: the client sees a cut stream
            raise _Cut(answer) from e
        try:
            await answer.write_eof()
        except ConnectionError as e:  # the client left; its handler is being cancelled too
            raise _Cut(answer) from e
        return answer
