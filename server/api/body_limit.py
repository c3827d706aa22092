"""`BodyLimit`: a request body is at most `max_request_bytes` and arrives within `body_timeout` seconds.

A plain ASGI middleware that checks the body as the app reads it, so it costs nothing until a route asks
for it: the /v1 routes check the API key first, and an unauthenticated client cannot make the server
take in a large body. A Content-Length over the limit is refused before a byte is read, a body without
one (chunked) once it passes the limit (413); a body still incomplete at the deadline gets a 408. Both
are raised as APIError from the app's own read, so the usual handler answers them. Any response that
goes out before the body was read to its end (those, a 401, a 404) closes the connection: the rest of
the body would otherwise be read as the next request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from iterserve.server.api.errors import APIError


class BodyLimit:
    def __init__(self, app, max_bytes: int, timeout: float, on_timeout: Callable[[], None] | None = None):
        self.app = app
        self.max_bytes = max_bytes
        self.timeout = timeout
        self.on_timeout = on_timeout  # counts a body that did not arrive in time

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        declared = _content_length(headers.get(b"content-length"))
        has_body = declared != 0 and (declared is not None or b"transfer-encoding" in headers)
        deadline = asyncio.get_running_loop().time() + self.timeout
        received = 0
        complete = not has_body

        async def limited_receive():
            nonlocal received, complete
            if complete:
                return await receive()
            if declared is not None and declared > self.max_bytes:
                raise self._too_large(f"its Content-Length is {declared} bytes")
            try:
                message = await asyncio.wait_for(receive(), max(deadline - asyncio.get_running_loop().time(), 0))
            except asyncio.TimeoutError:
                if self.on_timeout is not None:
                    self.on_timeout()
                raise APIError(408, f"the request body did not arrive within {self.timeout:g} s (--body-timeout)",
                               code="request_timeout") from None
            if message["type"] != "http.request":
                complete = True  # the client went away
                return message
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise self._too_large("it goes on past that")
            complete = not message.get("more_body", False)
            return message

        async def closing_send(message):
            if message["type"] == "http.response.start" and not complete:
                message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        await self.app(scope, limited_receive, closing_send)

    def _too_large(self, why: str) -> APIError:
        return APIError(413, f"the request body is too large: {why}; this server takes at most {self.max_bytes} "
                        "bytes (--max-request-bytes)", code="request_too_large")


def _content_length(value: bytes | None) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        return None  # h11 refuses such a request before it gets here
