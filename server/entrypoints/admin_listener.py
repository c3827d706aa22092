"""`iterserve serve --admin-port PORT`: /admin/* on a listener of its own, so that a network policy can
open the API port to clients and the admin port to the operator alone.

One app, one engine, one state: both listeners run in the same event loop and serve the same FastAPI
app, each behind a path filter. The main port answers /admin/* with the 404 of an unknown route; the
admin port answers everything else so. Signals stay with the main server (its SIGTERM drain); the
admin listener closes when the main server has finished.
"""

from __future__ import annotations

import asyncio
import logging

from iterserve.server.errors import InvalidRequestError

logger = logging.getLogger("iterserve.server")

ADMIN_PREFIX = "/admin"


def validate(port: int, admin_port: int | None, admin_token: str | None) -> None:
    if admin_port is None:
        return
    if not 1 <= admin_port <= 65535 or admin_port == port:
        raise InvalidRequestError("admin_port", f"must be in [1, 65535] and differ from port, got {admin_port}")
    if admin_token is None:
        raise InvalidRequestError("admin_port", "needs an admin token (--admin-token or ITERSERVE_ADMIN_TOKEN)")


def is_admin_path(path: str) -> bool:
    return path == ADMIN_PREFIX or path.startswith(ADMIN_PREFIX + "/")


class PathFilter:
    """An ASGI wrapper passing only admin paths (`admin=True`) or only the others."""

    def __init__(self, app, *, admin: bool):
        from iterserve.server.api.errors import error_response  # FastAPI: only once a server is built

        self.app = app
        self.admin = admin
        self.not_found = lambda: error_response(404, "Not Found")

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and is_admin_path(scope["path"]) != self.admin:
            return await self.not_found()(scope, receive, send)
        return await self.app(scope, receive, send)


def split(app, *, host: str, admin_port: int | None, log_level: str = "info"):
    """(the app for the main server, the admin listener or None). Without an admin port: `app` as it is."""
    if admin_port is None:
        return app, None
    import uvicorn

    class AdminServer(uvicorn.Server):
        def capture_signals(self):
            # the main server's handlers must stay installed: SIGTERM starts its drain
            return _no_signals()

    config = uvicorn.Config(PathFilter(app, admin=True), host=host, port=admin_port, log_level=log_level,
                            timeout_graceful_shutdown=5, access_log=False, lifespan="off")
    logger.info("admin API on http://%s:%d only", host, admin_port)
    return PathFilter(app, admin=False), AdminServer(config)


def run(main_server, admin) -> None:
    """Run the main server, and the admin listener (when there is one) in the same event loop until the
    main server exits. `main_server.run()` keeps choosing the loop (uvloop or asyncio, as configured);
    its `serve` is extended to start and stop the admin listener."""
    if admin is None:
        main_server.run()
        return
    serve = main_server.serve

    async def serve_both(sockets=None) -> None:
        admin_task = asyncio.create_task(admin.serve())
        try:
            await serve(sockets=sockets)
        finally:
            admin.should_exit = True
            await admin_task

    main_server.serve = serve_both
    main_server.run()


class _no_signals:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False
