"""The operator's /healthz: 200 while the replica beats, 503 once the beats stop, from a real listener."""

from __future__ import annotations

import httpx

from iterserve.operator.health import Health, serve
from tests.server_support import free_port


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_healthz_follows_the_beats():
    clock = Clock()
    health = Health(stale_after=60, clock=clock)
    port = free_port()
    server = serve(port, health, host="127.0.0.1")
    url = f"http://127.0.0.1:{port}"
    try:
        first = httpx.get(url + "/healthz")
        assert first.status_code == 200 and first.json()["role"] == "starting"
        clock.now += 50
        health.beat("standing by")
        clock.now += 59
        assert httpx.get(url + "/healthz").json() == {"status": "ok", "role": "standing by", "secondsSinceBeat": 59}
        clock.now += 2  # the beats stopped: an election thread gone, an event loop blocked
        stale = httpx.get(url + "/healthz")
        assert stale.status_code == 503 and stale.json()["status"] == "stale"
        health.beat("operating")
        assert httpx.get(url + "/healthz").status_code == 200
        assert httpx.get(url + "/metrics").status_code == 404
    finally:
        server.shutdown()
        server.server_close()
