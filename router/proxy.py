"""The router's ASGI app: picks a pod for each request and relays it, streaming chunk by chunk.

A plain ASGI callable rather than a framework: every request pays for whatever sits on this path, and
the proxy needs nothing but the raw body, the path and the headers. `/v1/completions` and
`/v1/chat/completions` are routed by the policy on their prompt; the other API routes (`/v1/models`,
`/tokenize`, ...) go to the least loaded pod. The router answers `/health` (it runs), `/ready` (some pod
is routable) and `/metrics` (its own) itself.

Failures: a pod that refuses the connection is marked down and the request goes to another pod; so does
one that drops the connection before its response head, or answers 503 `draining` (nothing was started
there). A pod's own answers, errors included, pass through unchanged. Once the response has started, a
pod that fails cuts the client's connection too, so a client never takes a truncated stream for a whole
one. A client that disconnects closes the pod's connection, which aborts the request there.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import aiohttp

from iterserve.router.metrics import RouterMetrics
from iterserve.router.pods import PodSet
from iterserve.router.policy import LeastLoad
from iterserve.router.prefix_key import routing_key

logger = logging.getLogger("iterserve.router")
KEYED_ROUTES = ("/v1/completions", "/v1/chat/completions")
OTHER_ROUTES = ("/tokenize", "/detokenize", "/version")
# hop-by-hop headers (RFC 9110 7.6.1) and those the next hop sets itself
_DROP_REQUEST = {b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer", b"transfer-encoding",
                 b"upgrade", b"host", b"content-length"}
_DROP_RESPONSE = {b"connection", b"keep-alive", b"transfer-encoding", b"date", b"server"}
_JSON = [(b"content-type", b"application/json")]


class UpstreamBroke(Exception):
    """A pod failed after the response had started: the client's connection is cut (see the docstring)."""


def _error(status: int, message: str, code: str) -> bytes:
    kind = "service_unavailable" if status == 503 else "invalid_request_error"
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()


async def _answer(send, status: int, body: bytes, headers=_JSON) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _wait_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _sent(session, ctx, params) -> None:
    ctx.trace_request_ctx.append(time.perf_counter())  # the request's head (and small body) is on the wire


async def _body(response: aiohttp.ClientResponse, read: bytes | None):
    if read is not None:  # read already (a 503 that was not `draining`)
        yield read
        return
    async for chunk in response.content.iter_any():  # as it arrives: no re-buffering
        yield chunk


def _draining(body: bytes) -> bool:
    try:
        return json.loads(body)["error"]["code"] == "draining"
    except (ValueError, KeyError, TypeError):
        return False


class Router:
    def __init__(self, pods: PodSet, policy_name: str, policy, *, prefix_chars: int = 256,
                 connect_timeout: float = 2.0, max_request_bytes: int = 32 * 2**20, max_retries: int = 3) -> None:
        self.pods, self.policy_name, self.policy = pods, policy_name, policy
        self.keyed = policy_name == "prefix-hash"  # least-load never reads the body
        self.prefix_chars, self.max_request_bytes, self.max_retries = prefix_chars, max_request_bytes, max_retries
        self.any_pod = LeastLoad()
        self.metrics = RouterMetrics(pods)
        # no read timeout: a long generation streams for minutes; keep-alive shorter than the pods' 5 s, so
        # the router never reuses a connection the pod is closing; the body passes through as the pod sent it
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout)
        self.session: aiohttp.ClientSession | None = None

    def _session(self) -> aiohttp.ClientSession:
        if self.session is None:  # in the running loop: aiohttp binds the session to it
            trace = aiohttp.TraceConfig()
            trace.on_request_headers_sent.append(_sent)
            self.session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=3.0), timeout=self._timeout,
                auto_decompress=False, skip_auto_headers=("User-Agent", "Accept-Encoding", "Accept"),
                trace_configs=[trace])
        return self.session

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            return await self._lifespan(receive, send)
        if scope["type"] != "http":
            return
        path = scope["path"]
        if path in KEYED_ROUTES or path.startswith("/v1/") or path in OTHER_ROUTES:
            return await self._proxy(scope, receive, send, keyed=self.keyed and path in KEYED_ROUTES)
        if path == "/health":
            return await _answer(send, 200, json.dumps({"status": "ok", "pods": len(self.pods.pods),
                                                        "healthy": len(self.pods.healthy())}).encode())
        if path == "/ready":
            if self.pods.healthy():
                return await _answer(send, 200, b'{"status": "ready"}')
            return await _answer(send, 503, _error(503, "no pod is routable", "no_pods"))
        if path == "/metrics":
            return await _answer(send, 200, self.metrics.render(),
                                 [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")])
        await _answer(send, 404, _error(404, f"no route {path}", "not_found"))

    async def _lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await self.pods.start()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.pods.stop()
                if self.session is not None:
                    await self.session.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _read_body(self, receive) -> bytes | None:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise asyncio.CancelledError  # gone before its body was in: nothing to route
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_request_bytes:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _proxy(self, scope, receive, send, keyed: bool) -> None:
        arrived = time.perf_counter()
        try:
            body = await self._read_body(receive)
        except asyncio.CancelledError:
            return
        if body is None:
            self.metrics.requests.labels("none", "413").inc()
            return await _answer(send, 413, _error(413, f"the request body exceeds {self.max_request_bytes} "
                                                        "bytes", "request_too_large"))
        key = routing_key(body, self.prefix_chars) if keyed else None
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"] if k not in _DROP_REQUEST]
        target = scope["raw_path"].decode("latin-1") if scope.get("raw_path") else scope["path"]
        if scope.get("query_string"):
            target += "?" + scope["query_string"].decode("latin-1")
        work = asyncio.ensure_future(self._route(scope["method"], target, headers, body, key, arrived, send))
        watcher = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
        if work in done:
            await work  # its exception, if any, reaches uvicorn: the client's connection is cut
        else:  # the client left: cancelling closes the pod's connection, which aborts the request there
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)

    async def _route(self, method, target, headers, body, key, arrived, send) -> None:
        tried: set[str] = set()
        policy = self.policy if key is not None else self.any_pod
        while True:
            candidates = [p.load for p in self.pods.healthy(exclude=tried)]
            if not candidates or len(tried) > self.max_retries:
                self.metrics.requests.labels("none", "503").inc()
                why = "no pod is routable" if not tried else f"{len(tried)} pods failed to take the request"
                return await _answer(send, 503, _error(503, why, "no_pods"))
            decision = policy.pick(candidates, key)
            outcome = "retry" if tried else ("spilled" if decision.spilled else "primary")
            self.metrics.decisions.labels(self.policy_name, outcome).inc()
            pod = self.pods.pods[decision.pod]
            tried.add(pod.url)
            pod.load.in_flight += 1
            try:
                if await self._attempt(pod, method, target, headers, body, arrived, send):
                    return
            finally:
                pod.load.in_flight -= 1

    async def _attempt(self, pod, method, target, headers, body, arrived, send) -> bool:
        """One try on `pod`: False when nothing reached the client and another pod may take the request."""
        sent_at: list[float] = []
        try:
            response = await self._session().request(method, pod.url + target, headers=headers, data=body,
                                                     allow_redirects=False, trace_request_ctx=sent_at)
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as e:
            self.metrics.upstream_failures.labels(pod.url, "connect").inc()
            self.pods.mark_down(pod, f"connect: {type(e).__name__}")
            return False
        except aiohttp.ClientError as e:  # it dropped the connection before answering: nothing was sent on
            self.metrics.upstream_failures.labels(pod.url, type(e).__name__).inc()
            logger.warning("pod %s dropped a request before answering (%r); retrying elsewhere", pod.url, e)
            return False
        done = False
        try:
            if sent_at:
                self.metrics.to_upstream.observe(sent_at[0] - arrived)
            read = await response.read() if response.status == 503 else None  # one small JSON error
            if read is not None and _draining(read):
                self.metrics.upstream_failures.labels(pod.url, "draining").inc()
                self.pods.mark_down(pod, "draining")
                done = True
                return False
            await self._relay(response, read, pod, arrived, send)
            done = True
            return True
        finally:
            # a response cut short (the client left, the pod failed) closes its connection, which the pod
            # reads as a disconnect and aborts the request; a whole one goes back to the pool
            response.release() if done else response.close()

    async def _relay(self, response: aiohttp.ClientResponse, read: bytes | None, pod, arrived: float,
                     send) -> None:
        head_at = time.perf_counter()
        headers = [(k, v) for k, v in response.raw_headers if k.lower() not in _DROP_RESPONSE]
        await send({"type": "http.response.start", "status": response.status, "headers": headers})
        self.metrics.to_client.observe(time.perf_counter() - head_at)
        self.metrics.requests.labels(pod.url, str(response.status)).inc()
        first = True
        try:
            async for chunk in _body(response, read):
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                if first:
                    self.metrics.first_byte.observe(time.perf_counter() - arrived)
                    first = False
        except aiohttp.ClientError as e:
            self.metrics.upstream_failures.labels(pod.url, "mid_response").inc()
            raise UpstreamBroke(f"pod {pod.url} failed mid-response: {e!r}") from e
        await send({"type": "http.response.body", "body": b"", "more_body": False})
