"""Helpers for the router's live tests: `iterserve router` as a subprocess, and reading its metrics."""

from __future__ import annotations

import asyncio
import concurrent.futures
import subprocess
import sys
import threading

import httpx

from tests.server_support import ROOT, free_port, metric_value, start_subprocess
from tests.waiting import wait_until


def start_router(*endpoints: str, policy: str = "least-load", extra: tuple[str, ...] = ()
                 ) -> tuple[subprocess.Popen, str]:
    """`iterserve router` over `endpoints` (or the --dns-name in `extra`), once it answers /health (pods
    may still be unhealthy)."""
    port = free_port()
    where = ["--endpoints", ",".join(endpoints)] if endpoints else []
    cmd = [sys.executable, "-m", "iterserve.server.entrypoints.cli", "router", "--host", "127.0.0.1",
           "--port", str(port), *where, "--policy", policy,
           "--scrape-interval", "0.1", "--log-level", "warning", *extra]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"

    def up():
        if proc.poll() is not None:
            raise RuntimeError(f"the router exited with {proc.returncode}: {proc.communicate()[0]}")
        try:
            return httpx.get(url + "/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(up, timeout=30, what="the router to answer", interval=0.05)
    return proc, url


def stop(proc: subprocess.Popen) -> str:
    """Stop a process this test started; its output."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.communicate()[0] or ""


def routed(router_url: str, pod_url: str, code: str = "200") -> float:
    """How many requests the router sent to `pod_url` that answered `code`."""
    text = httpx.get(router_url + "/metrics").text
    try:
        return metric_value(text, "iterserve:router_requests_total", pod=pod_url, code=code)
    except KeyError:
        return 0.0


def router_gauge(router_url: str, name: str, pod_url: str) -> float:
    return metric_value(httpx.get(router_url + "/metrics").text, name, pod=pod_url)


def wait_healthy(router_url: str, *pods: str) -> None:
    wait_until(lambda: all(router_gauge(router_url, "iterserve:router_pod_healthy", p) == 1 for p in pods),
               timeout=30, what=f"the router to see {pods} healthy", interval=0.05)


def start_pods(n: int, *args: str) -> list[tuple[subprocess.Popen, str]]:
    """`n` servers started at once (each takes a minute or more to load on a busy 2-core machine)."""
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(start_subprocess, *args, ready_timeout=400) for _ in range(n)]
        started, errors = [], []
        for f in futures:
            try:
                started.append(f.result())
            except Exception as e:  # stop the others before failing
                errors.append(e)
    if errors:
        for proc, _ in started:
            stop(proc)
        raise errors[0]
    return started


class ThreadedPod:
    """A STAND-IN pod for tests that need a pod to send exact bytes: a raw asyncio server in a thread of the
    test, on loopback. Subclasses answer each connection in `_handle(reader, writer)`."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        assert self._ready.wait(10), "the stand-in did not start"
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", self.port))
        self._ready.set()
        self._loop.run_forever()
        server.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError
