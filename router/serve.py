"""Runs the router: aiohttp's HTTP server on uvloop, in one process or in several sharing the port.

aiohttp's server parses HTTP in C and hands the handler the raw request, and uvloop runs the event
loop's bookkeeping and socket calls in C: per relayed chunk that leaves one read from the pod and one
write to the client in Python (router/proxy.py). With `workers` > 1 each worker is a whole router
(its own pod scrapes, in-flight counts and metrics) bound to the same port with SO_REUSEPORT, and the
kernel spreads connections across them.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import multiprocessing
import multiprocessing.connection
import signal
import sys

from aiohttp import web

logger = logging.getLogger("iterserve.router")


async def _serve(make_router, host: str, port: int, reuse_port: bool, drain_timeout: float) -> None:
    router = make_router()
    await router.start()
    # handler_cancellation: a client that disconnects cancels its handler, which aborts the pod's request
    server = web.Server(router.handle, handler_cancellation=True, access_log=None)
    # after SIGTERM: no new connections, and open requests (streams) get drain_timeout seconds to finish
    runner = web.ServerRunner(server, shutdown_timeout=drain_timeout)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=1024, reuse_port=reuse_port or None)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await site.start()
        # what startup built lives as long as the process: keep it out of every later collection, and
        # collect the young generation less often (a relayed chunk allocates a few short-lived objects)
        gc.freeze()
        gc.set_threshold(20_000, 20, 20)
        await stop.wait()
    finally:
        await runner.cleanup()
        await router.stop()


def _run_one(make_router, host: str, port: int, reuse_port: bool, drain_timeout: float,
             log_level: int = logging.INFO) -> None:
    if not logging.getLogger().handlers:  # a spawned worker: log as the parent does
        logging.basicConfig(level=log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        import uvloop
    except ImportError:  # the [router] extra brings it; without it the standard loop serves, slower
        asyncio.run(_serve(make_router, host, port, reuse_port, drain_timeout))
    else:
        uvloop.run(_serve(make_router, host, port, reuse_port, drain_timeout))


def serve(make_router, host: str, port: int, workers: int = 1, drain_timeout: float = 30.0) -> int:
    """Serve routers built by `make_router` (called in each worker, so that nothing crosses a fork); the
    exit status. Several workers: SIGTERM stops them all, and one that dies stops the others (the pod
    restarts whole rather than serving with a share of its capacity gone unnoticed)."""
    if workers == 1:
        _run_one(make_router, host, port, False, drain_timeout)
        return 0
    ctx = multiprocessing.get_context("spawn")
    level = logging.getLogger().level
    procs = [ctx.Process(target=_run_one, args=(make_router, host, port, True, drain_timeout, level))
             for _ in range(workers)]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        for proc in procs:
            proc.start()
        ended = multiprocessing.connection.wait([p.sentinel for p in procs])
        code = next(p.exitcode for p in procs if p.sentinel in ended)
        logger.error("a router worker exited with %s: stopping the others", code)
        return 1
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()  # SIGTERM: each drains as a single router would
        for proc in procs:
            proc.join(drain_timeout + 5)
