"""The router's request handler: picks a pod for each request and relays it, streaming as it arrives.

It is an aiohttp low-level handler (router/serve.py runs the server): aiohttp's C HTTP parser reads the
request, the handler sees the raw body, the path and the headers, and nothing else sits on the path a
relayed chunk takes (one read from the pod, one write to the client). `/v1/completions` and
`/v1/chat/completions` are routed by the policy on their prompt; the other API routes (`/v1/models`,
`/tokenize`, ...) go to the least loaded pod. The router answers `/health` (it runs), `/ready` (some pod
is routable) and `/metrics` (its own) itself.

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

import json
import logging
import time

import aiohttp
from aiohttp import web

from iterserve.router.metrics import RouterMetrics
from iterserve.router.pods import PodSet
from iterserve.router.policy import LeastLoad, estimated_tokens
from iterserve.router.prefix_key import routing_key

logger = logging.getLogger("iterserve.router")
KEYED_ROUTES = ("/v1/completions", "/v1/chat/completions")
OTHER_ROUTES = ("/tokenize", "/detokenize", "/version")
# hop-by-hop headers (RFC 9110 7.6.1) and those the next hop sets itself
_DROP_REQUEST = {b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer", b"transfer-encoding",
                 b"upgrade", b"host", b"content-length"}
_DROP_RESPONSE = {b"connection", b"keep-alive", b"transfer-encoding", b"date", b"server"}
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


class _Try:
    """What aiohttp's trace signals tell about one request to a pod: when it was on the wire, and whether
    it took an idle pooled connection or opened one."""

    __slots__ = ("sent_at", "reused", "opened")

    def __init__(self) -> None:
        self.sent_at: float | None = None
        self.reused = self.opened = False


async def _sent(session, ctx, params) -> None:
    ctx.trace_request_ctx.sent_at = time.perf_counter()  # the request's head (and small body) is on the wire


async def _reused(session, ctx, params) -> None:
    ctx.trace_request_ctx.reused = True


async def _opened(session, ctx, params) -> None:
    ctx.trace_request_ctx.opened = True


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
        # no read timeout: a long generation streams for minutes; the body passes through as the pod sent it
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout)
        self.session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        """In the running loop (aiohttp binds the session to it): the pods' first scrape, then the session."""
        await self.pods.start()
        trace = aiohttp.TraceConfig()
        trace.on_request_headers_sent.append(_sent)
        trace.on_connection_reuseconn.append(_reused)
        trace.on_connection_create_end.append(_opened)
        # idle connections to the pods are kept `idle_timeout` s, across the gaps of ordinary traffic: a burst
        # after a lull then finds them open instead of paying a connect each. The pods keep theirs longer
        # (`iterserve serve --keep-alive-timeout`, 75 s), so the router, not the pod, closes an idle one;
        # a pod that closes one as it is reused anyway (another server, a shorter setting) costs a retry
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=self.idle_timeout), timeout=self._timeout,
            auto_decompress=False, skip_auto_headers=("User-Agent", "Accept-Encoding", "Accept"),
            trace_configs=[trace])

    async def stop(self) -> None:
        await self.pods.stop()
        if self.session is not None:
            await self.session.close()

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
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.raw_headers
                   if k.lower() not in _DROP_REQUEST]
        try:
            return await self._route(request, headers, body, key, arrived)
        except _Cut as cut:
            return cut.answer

    async def _route(self, request, headers, body, key, arrived) -> web.StreamResponse:
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
                answer = await self._attempt(pod, request, headers, body, arrived)
            finally:
                pod.load.in_flight -= 1
                if pod.load.unscraped.pop(id(request), None) is None:
                    pod.load.ended += 1  # the pod's last scrape counted it: that count is one too high now
            if answer is not None:
                return answer

    async def _attempt(self, pod, request, headers, body, arrived) -> web.StreamResponse | None:
        """One try on `pod`: None when nothing reached the client and another pod may take the request."""
        assert self.session is not None, "requests arrive only between start() and stop()"
        for _ in range(self.max_retries + 1):
            attempt = _Try()
            try:
                response = await self.session.request(request.method, pod.url + request.raw_path, headers=headers,
                                                      data=body, allow_redirects=False, trace_request_ctx=attempt)
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as e:
                self.metrics.upstream_failures.labels(pod.url, "connect").inc()
                self.pods.mark_down(pod, f"connect: {type(e).__name__}")
                return None
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as e:
                if not attempt.reused:
                    self._dropped(pod, e)
                    return None
                # a pooled connection the pod closed while idle, as the request went out (the race every
                # proxy with kept-alive upstreams has): the pod read nothing; again on the same pod, whose
                # load the policy chose it for, on another connection (aiohttp retries only idempotent methods)
                self.metrics.upstream_failures.labels(pod.url, "stale_connection").inc()
                continue
            except aiohttp.ClientError as e:
                self._dropped(pod, e)
                return None
            finally:
                if attempt.opened:
                    self.metrics.connections.labels(pod.url).inc()
            return await self._answer(response, attempt, pod, request, arrived)
        return None

    def _dropped(self, pod, e: aiohttp.ClientError) -> None:
        """It dropped the connection before answering: nothing was sent on, another pod may take it."""
        self.metrics.upstream_failures.labels(pod.url, type(e).__name__).inc()
        logger.warning("pod %s dropped a request before answering (%r); retrying elsewhere", pod.url, e)

    async def _answer(self, response: aiohttp.ClientResponse, attempt: _Try, pod, request, arrived: float
                      ) -> web.StreamResponse | None:
        """The pod's answer relayed, or None when it is draining (nothing was started there)."""
        done = False
        try:
            if attempt.sent_at is not None:
                self.metrics.to_upstream.observe(attempt.sent_at - arrived)
            read = await response.read() if response.status == 503 else None  # one small JSON error
            if read is not None and _draining(read):
                self.metrics.upstream_failures.labels(pod.url, "draining").inc()
                self.pods.mark_down(pod, "draining")
                done = True
                return None
            answer = await self._relay(response, read, pod, request, arrived)
            done = True
            return answer
        finally:
            # a response cut short (the client left, the pod failed) closes its connection, which the pod
            # reads as a disconnect and aborts the request; a whole one goes back to the pool
            response.release() if done else response.close()

    async def _relay(self, response: aiohttp.ClientResponse, read: bytes | None, pod, request, arrived: float
                     ) -> web.StreamResponse:
        head_at, content = time.perf_counter(), response.content
        chunk = read if read is not None else content.read_nowait()  # what came with the pod's head
        answer = web.StreamResponse(status=response.status, reason=response.reason, headers=[
            (k.decode("latin-1"), v.decode("latin-1")) for k, v in response.raw_headers
            if k.lower() not in _DROP_RESPONSE])
        # writes to a socket are most of the relay's cost: the head leaves with the first body bytes when
        # both are here already (aiohttp's own Response buffers its head so), at once when not, so that a
        # client sees a queued request's head before its first token
        answer._send_headers_immediately = not chunk
        await answer.prepare(request)
        self.metrics.to_client.observe(time.perf_counter() - head_at)
        self.metrics.requests.labels(pod.url, str(response.status)).inc()
        first = True
        while True:
            if not chunk:
                try:
                    chunk = await content.readany()  # all the pod has sent so far: no re-buffering
                except aiohttp.ClientError as e:
                    self.metrics.upstream_failures.labels(pod.url, "mid_response").inc()
                    logger.warning("pod %s failed mid-response (%r): cutting the client's connection", pod.url, e)
                    request.transport.close()  # before any terminating chunk: the client sees a cut stream
                    raise _Cut(answer) from e
                if not chunk:
                    return answer
            last = content.is_eof()  # the pod's whole response is read: its end goes in the same write
            try:
                await (answer.write_eof(chunk) if last else answer.write(chunk))
            except ConnectionError as e:  # the client left; its handler is being cancelled too
                raise _Cut(answer) from e
            if first:
                self.metrics.first_byte.observe(time.perf_counter() - arrived)
                first = False
            if last:
                return answer
            chunk = b""
