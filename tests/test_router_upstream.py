"""The router's connections to a pod: a pooled connection that the pod closes just as the router reuses
it (the race of every proxy with kept-alive upstreams) is retried on the same pod on a new connection,
and the client never sees it; a pod that drops a request on a connection just opened is not tried again.

The pod here is a STAND-IN, a raw asyncio HTTP server in a thread of this test: closing a kept-alive
connection at the moment a request arrives on it is a race with a real server, which this one makes
happen on every request after a connection's first. The router is the real `iterserve router`.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from benchmarks.router_overhead import next_request
from tests.router_support import ThreadedPod, start_router, stop, wait_healthy
from tests.server_support import free_port, metric_value

ANSWER = b'{"id": "cmpl-standin", "object": "text_completion", "choices": [{"index": 0, "text": " ok"}]}'


class StandInPod(ThreadedPod):
    """Answers /metrics always (as the benchmark's stand-in does), and a POST only when it is the first
    one on its connection (`drop_all`: never); a later POST is read and its connection closed (`reset`:
    aborted, an RST) without an answer."""

    def __init__(self, reset: bool = False, drop_all: bool = False) -> None:
        super().__init__()
        self.reset, self.drop_all = reset, drop_all
        self.posts, self.dropped = 0, 0

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        posts_here = 0
        try:
            while True:
                await next_request(reader, writer)
                self.posts, posts_here = self.posts + 1, posts_here + 1
                if self.drop_all or posts_here > 1:
                    self.dropped += 1
                    writer.transport.abort() if self.reset else writer.close()
                    return
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                             % (len(ANSWER), ANSWER))
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()


def test_the_pods_keep_idle_connections_longer_than_the_router():
    """A backend must keep an idle connection longer than the proxy in front of it, or the proxy sends
    requests on connections the backend is closing (the 502 race of nginx and load balancers)."""
    import argparse

    from iterserve.router.cli import register
    from iterserve.server.api.limits import ServerLimits

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    router = parser.parse_args(["router", "--endpoints", "http://a:8000"])
    assert ServerLimits().keep_alive_timeout > router.backend_keep_alive_timeout


def _metric(router: str, name: str, **labels) -> float:
    try:
        return metric_value(httpx.get(router + "/metrics").text, name, **labels)
    except KeyError:
        return 0.0


@pytest.mark.parametrize("reset", [False, True], ids=["closed", "reset"])
def test_a_pooled_connection_the_pod_closed_is_retried_on_a_new_one(reset):
    with StandInPod(reset=reset) as pod:
        proc, router = start_router(pod.url)
        try:
            wait_healthy(router, pod.url)
            for i in range(3):  # each after the first finds the pooled connection, which the pod then closes
                r = httpx.post(router + "/v1/completions", json={"model": "m", "prompt": f"hi {i}"})
                assert (r.status_code, r.content) == (200, ANSWER), r.text
            assert pod.dropped == 2 and pod.posts == 5
            assert _metric(router, "iterserve:router_upstream_failures_total", pod=pod.url,
                           reason="stale_connection") == 2
            assert _metric(router, "iterserve:router_upstream_connections_total", pod=pod.url) == 3
            assert _metric(router, "iterserve:router_requests_total", pod=pod.url, code="200") == 3
        finally:
            out = stop(proc)
    assert "Traceback" not in out, out


def test_a_request_dropped_on_a_new_connection_is_not_sent_to_that_pod_again():
    """A pod that drops a request on a connection just opened may have read it: the router tries no
    more there (with no other pod: a 503), and does not mistake it for a stale pooled connection."""
    with StandInPod(drop_all=True) as pod:
        proc, router = start_router(pod.url)
        try:
            wait_healthy(router, pod.url)
            r = httpx.post(router + "/v1/completions", json={"model": "m", "prompt": "hi"})
            assert r.status_code == 503 and r.json()["error"]["code"] == "no_pods"
            assert pod.posts == 1
            assert _metric(router, "iterserve:router_upstream_failures_total", pod=pod.url,
                           reason="stale_connection") == 0
        finally:
            out = stop(proc)
    assert "Traceback" not in out, out


async def serve_metrics(handler):
    """A stand-in pod's /metrics on a free loopback port: (its runner, to clean up; the port)."""
    from aiohttp import web

    app = web.Application()
    app.router.add_get("/metrics", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, port


@pytest.mark.parametrize(("slow_scrapes", "taken_out"), [(1, False), (2, False), (3, True)])
def test_a_pod_leaves_routing_only_after_failure_threshold_slow_scrapes_in_a_row(slow_scrapes, taken_out):
    # the pod's /metrics answers after the scrape's timeout `slow_scrapes` times, then promptly
    from aiohttp import web

    from iterserve.router.pods import Discovery, PodSet

    async def main() -> list[bool]:
        served = 0

        async def metrics(request):
            nonlocal served
            served += 1
            if 1 < served <= 1 + slow_scrapes:  # the first scrape makes it healthy
                await asyncio.sleep(0.5)
            return web.Response(text="vllm:num_requests_waiting 0.0\n")

        runner, port = await serve_metrics(metrics)
        pods = PodSet(Discovery([f"http://127.0.0.1:{port}"]), timeout=0.2, failure_threshold=3)
        downs = []
        mark_down = pods.mark_down
        pods.mark_down = lambda pod, why: downs.append(why) or mark_down(pod, why)
        await pods.start()  # one scrape now, then one every `interval`
        while served < slow_scrapes + 3:  # the slow ones, and two prompt ones after them
            await asyncio.sleep(0.05)
        healthy = bool(pods.healthy())
        await pods.stop()
        await runner.cleanup()
        return downs, healthy

    downs, healthy = asyncio.run(main())
    assert bool(downs) is taken_out, downs
    assert healthy, "a prompt scrape makes the pod routable again"


def test_a_pod_discovery_drops_takes_no_new_requests_and_is_forgotten_once_its_requests_end():
    # two pods answer /metrics; the second leaves discovery (a terminating pod leaves the headless Service's
    # answer before its SIGTERM, so it still answers) while a request of this router runs there
    from aiohttp import web

    from iterserve.router.pods import Discovery, PodSet

    async def main():
        async def metrics(request):
            return web.Response(text="vllm:num_requests_waiting 0.0\n")

        runner, port = await serve_metrics(metrics)
        a, b = f"http://127.0.0.1:{port}", f"http://localhost:{port}"
        discovery = Discovery([a, b])
        pods = PodSet(discovery, timeout=1.0)
        await pods.start()
        seen = [(sorted(pods.pods), sorted(p.url for p in pods.healthy()))]
        pods.pods[b].load.in_flight = 1
        discovery.endpoints = [a]
        await pods.refresh()
        seen.append((sorted(pods.pods), sorted(p.url for p in pods.healthy())))
        pods.pods[b].load.in_flight = 0
        await pods.refresh()
        seen.append((sorted(pods.pods), sorted(p.url for p in pods.healthy())))
        await pods.stop()
        await runner.cleanup()
        return seen, a, b

    seen, a, b = asyncio.run(main())
    assert seen == [([a, b], [a, b]),  # both listed and answering
                    ([a, b], [a]),  # b kept for its request in flight, routable no more
                    ([a], [a])]  # its request ended: forgotten


@pytest.mark.parametrize("endpoint", ["https://pod:8000", "pod:8000", "http://pod:8000/v1", "http:///nohost"])
def test_an_endpoint_that_is_not_a_pods_plain_http_base_url_is_refused(endpoint):
    from iterserve.router.pods import Discovery

    with pytest.raises(ValueError, match="http://host:port"):
        Discovery([endpoint])


def test_pod_addresses_come_from_their_urls():
    from iterserve.router.pods import Discovery, Pod

    assert Discovery(["http://10.0.0.5:8000/", "http://[fd00::1]:8000"]).endpoints == \
        ["http://10.0.0.5:8000", "http://[fd00::1]:8000"]
    assert [(p.host, p.port) for p in (Pod("http://10.0.0.5:8000"), Pod("http://[fd00::1]:9000"), Pod("http://a"))] \
        == [("10.0.0.5", 8000), ("fd00::1", 9000), ("a", 80)]
