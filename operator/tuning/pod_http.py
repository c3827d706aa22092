"""The one HTTP client for the operator's calls to its pods: the tuners' /metrics scrapes and the admin API
(GET/PATCH /admin/scheduler) of the resync passes and the tuners.

Shared, not one per call: making an httpx client builds an SSL context (it loads the CA bundle) even for
plain-HTTP pods, and that costs more than the call itself. With a client per call (`httpx.get`), 45% of a
200-service operator's CPU went there (docs/benchmarks-operator.md). An httpx.Client is safe to use from
the resync and tuner threads at once; it keeps idle connections to pods for the next tick.
"""

from __future__ import annotations

import threading

import httpx

# No cap on connections (each call has its own timeout; a pool wait would add to it), a few kept idle.
_LIMITS = httpx.Limits(max_connections=None, max_keepalive_connections=32)
_client: httpx.Client | None = None
_lock = threading.Lock()


def pod_client() -> httpx.Client:
    global _client
    with _lock:
        if _client is None:
            _client = httpx.Client(limits=_LIMITS)
        return _client
