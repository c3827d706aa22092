"""The outermost layer of the app: counts every API response (/v1, /tokenize, /detokenize) by route and
status code, and answers an exception nothing else handled with one logged, counted, OpenAI-shaped 500.

A plain ASGI middleware, not BaseHTTPMiddleware: that one would buffer the receive channel the
disconnect watcher reads and delay streamed chunks. It catches what the app raises itself rather than
leaving it to Starlette's ServerErrorMiddleware, which would answer outside this counter and re-raise,
so that uvicorn logged the same error a second time.
"""

from __future__ import annotations

import logging

from iterserve.server.api.errors import error_response

logger = logging.getLogger("iterserve.server")

API_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize")


class ResponseCounter:
    def __init__(self, app, metrics):
        self.app = app
        self.metrics = metrics  # api.metrics.Metrics, or None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        route = None
        if self.metrics is not None and (path.startswith("/v1/") or path in API_ROUTES):
            route = path if path in API_ROUTES else "other"
        started = False

        async def counting_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if route is not None:
                    self.metrics.observe_response(route, message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception as exc:  # noqa: BLE001 - the last place an error can be answered
            logger.exception("unhandled error on %s %s", scope["method"], path)
            if started:
                return  # mid-response: uvicorn closes the connection, as nothing more can be said
            response = error_response(500, f"internal error: {type(exc).__name__}", None, "internal_error")
            await response(scope, receive, counting_send)
