"""LOAD-TEST STAND-IN for the pods of an operator scale test: no model, no engine, only what the operator
calls on a pod. One process serves every pod of the fleet, each on its own loopback address (the podIP
the harness wrote), on the ports the operator's pods use:

- HTTP_PORT `/metrics`: the server's exposition format with the vLLM metric names the tuner reads
  (common/wire.py), counters growing with time as under a steady load, each answer after
  `--scrape-delay-ms` (a real server's /metrics is not free either, and a scrape that takes time is what
  makes concurrent scrapes overlap, so that the operator's bound on them shows);
- ADMIN_PORT `/admin/scheduler`: GET the pod's live knobs, PATCH some of them (bearer token required).

A control API on 127.0.0.1 (`--control-port`) is the harness's: `POST /listen {"host": ...}` serves one
more pod address, `GET /stats` says what the operator did: scrapes per address, the most scrapes in
flight at once, every knob PATCH with its wall-clock time.

Run by benchmarks/operator_scale.py; not a server anyone should deploy.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from aiohttp import web

from iterserve.common.wire import (
    ADMIN_PORT,
    ADMIN_SCHEDULER_PATH,
    GENERATION_TOKENS,
    HTTP_PORT,
    HTTP_RESPONSES,
    ITL,
    KNOB_DEFAULTS,
    KV_USAGE,
    PREEMPTIONS,
    PROMPT_TOKENS,
    QUEUE_TIME,
    REQUESTS,
    RUNNING,
    STEP_FAILURES,
    TTFT,
    WAITING,
)

# A steady synthetic load per pod: requests/s, tokens per request, and where TTFT / ITL / queue time fall.
REQUEST_RATE = 2.0
PROMPT_TOKENS_PER_REQUEST, GENERATION_TOKENS_PER_REQUEST = 200, 100
HISTOGRAM_SHAPES = {  # histogram -> (bucket bounds in s, share of observations at or below each)
    TTFT: ((0.05, 0.1, 0.25, 0.5, 1.0), (0.2, 0.6, 0.9, 0.99, 1.0)),
    ITL: ((0.01, 0.025, 0.05, 0.1), (0.3, 0.8, 0.99, 1.0)),
    QUEUE_TIME: ((0.01, 0.1, 1.0), (0.7, 0.95, 1.0)),
}


def exposition(elapsed_s: float) -> str:
    """One pod's /metrics after `elapsed_s` seconds of the synthetic load."""
    requests = REQUEST_RATE * elapsed_s
    lines = []

    def counter(name: str, value: float, labels: str = "") -> None:
        family = name.removesuffix("_total")
        lines.extend([f"# TYPE {family} counter", f"{name}{{{labels}}} {value}"])

    counter(REQUESTS, requests, 'finished_reason="length"')
    counter(PROMPT_TOKENS, requests * PROMPT_TOKENS_PER_REQUEST)
    counter(GENERATION_TOKENS, requests * GENERATION_TOKENS_PER_REQUEST)
    counter(PREEMPTIONS, 0.0)
    counter(STEP_FAILURES, 0.0)
    counter(HTTP_RESPONSES, requests, 'route="/v1/completions",code="200"')
    for name, value in ((WAITING, 0.0), (RUNNING, REQUEST_RATE), (KV_USAGE, 0.25)):
        lines.extend([f"# TYPE {name} gauge", f"{name} {value}"])
    for name, (bounds, shares) in HISTOGRAM_SHAPES.items():
        count = requests * (GENERATION_TOKENS_PER_REQUEST - 1 if name == ITL else 1)
        lines.append(f"# TYPE {name} histogram")
        lines.extend(f'{name}_bucket{{le="{le}"}} {count * share}' for le, share in zip(bounds, shares, strict=True))
        lines.append(f'{name}_bucket{{le="+Inf"}} {count}')
        lines.append(f"{name}_sum {count * bounds[0]}")
        lines.append(f"{name}_count {count}")
    return "\n".join(lines) + "\n"


class Fleet:
    """Every pod address served, and what the operator asked of them."""

    def __init__(self, scrape_delay_s: float):
        self.scrape_delay_s = scrape_delay_s
        self.started = time.monotonic()
        self.scrapes: dict[str, int] = {}
        self.in_flight = 0
        self.max_in_flight = 0
        self.knob_gets = 0
        self.knob_patches: list[dict] = []  # {"host", "t" (wall clock), "knobs"}
        self.knobs: dict[str, dict[str, int]] = {}
        self.runners: list[web.AppRunner] = []

    async def metrics(self, request: web.Request) -> web.Response:
        host = request.transport.get_extra_info("sockname")[0]
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.scrape_delay_s)
            self.scrapes[host] = self.scrapes.get(host, 0) + 1
            text = exposition(time.monotonic() - self.started)
        finally:
            self.in_flight -= 1
        return web.Response(text=text, content_type="text/plain", charset="utf-8")

    async def scheduler(self, request: web.Request) -> web.Response:
        if not request.headers.get("Authorization", "").startswith("Bearer "):
            return web.json_response({"error": {"message": "admin token required"}}, status=401)
        host = request.transport.get_extra_info("sockname")[0]
        knobs = self.knobs.setdefault(host, dict(KNOB_DEFAULTS))
        if request.method == "PATCH":
            change = await request.json()
            changed = {k: {"old": knobs.get(k), "new": v} for k, v in change.items() if knobs.get(k) != v}
            knobs.update(change)
            self.knob_patches.append({"host": host, "t": time.time(), "knobs": change})
            return web.json_response({"knobs": knobs, "changed": changed})
        self.knob_gets += 1
        return web.json_response({"knobs": knobs, "ranges": {}, "num_changes": len(self.knob_patches)})

    async def listen(self, request: web.Request) -> web.Response:
        host = (await request.json())["host"]
        for port, route, handler, methods in ((HTTP_PORT, "/metrics", self.metrics, ("GET",)),
                                              (ADMIN_PORT, ADMIN_SCHEDULER_PATH, self.scheduler, ("GET", "PATCH"))):
            app = web.Application()
            for method in methods:
                app.router.add_route(method, route, handler)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, host, port).start()
            self.runners.append(runner)
        self.scrapes.setdefault(host, 0)
        return web.json_response({"host": host})

    async def stats(self, _request: web.Request) -> web.Response:
        return web.json_response({"scrapes": self.scrapes, "max_in_flight": self.max_in_flight,
                                  "knob_gets": self.knob_gets, "knob_patches": self.knob_patches})


async def serve(control_port: int, scrape_delay_s: float) -> None:
    fleet = Fleet(scrape_delay_s)
    control = web.Application()
    control.router.add_post("/listen", fleet.listen)
    control.router.add_get("/stats", fleet.stats)
    runner = web.AppRunner(control, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", control_port).start()
    print(f"metrics stand-in: control API on 127.0.0.1:{control_port}", flush=True)
    await asyncio.Event().wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--control-port", type=int, required=True)
    parser.add_argument("--scrape-delay-ms", type=float, default=20.0)
    args = parser.parse_args()
    asyncio.run(serve(args.control_port, args.scrape_delay_ms / 1000))


if __name__ == "__main__":
    main()
