"""/healthz for the operator Deployment's probes, answered by every replica, leader or standby.

kopf's own liveness endpoint runs only inside kopf, i.e. only in the leader: a standby would fail it and
be restarted in a loop. Here the replica's main activity beats instead: the leader-election wait while
standing by (operator/leader.py), then a task on kopf's event loop while leading (handlers.py). No beat
for `STALE_AFTER_S` (a dead election thread, a blocked event loop) makes /healthz answer 503, and the
kubelet restarts the container.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

STALE_AFTER_S = 60.0
BEAT_EVERY_S = 5.0


class Health:
    def __init__(self, stale_after: float = STALE_AFTER_S, clock=time.monotonic):
        self.stale_after = stale_after
        self.clock = clock
        self.role = "starting"
        self._last = clock()  # a start counts as a beat: the probe's initial delay covers the rest

    def beat(self, role: str) -> None:
        self.role, self._last = role, self.clock()

    def check(self) -> tuple[bool, dict]:
        age = self.clock() - self._last
        return age <= self.stale_after, {"role": self.role, "secondsSinceBeat": round(age, 1)}


def serve(port: int, health: Health, host: str = "0.0.0.0") -> ThreadingHTTPServer:
    """Answer GET /healthz on `port` from a daemon thread: 200 while beating, else 503 (JSON body)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path.split("?")[0] != "/healthz":
                self.send_error(404)
                return
            ok, body = health.check()
            data = json.dumps({"status": "ok" if ok else "stale", **body}).encode()
            self.send_response(200 if ok else 503)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args) -> None:  # a probe every few seconds is not worth a log line
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="healthz", daemon=True).start()
    return server
