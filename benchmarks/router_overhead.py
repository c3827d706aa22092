"""What `iterserve router` costs: its added latency at N concurrent streams, and requests/s on one core.

The upstream is a STAND-IN, not a model server: a tiny asyncio HTTP server (this script, `--stand-in`)
that answers every POST with a fixed SSE stream (`--events` chunks, `--itl` seconds apart, as a decoding
pod would) and /metrics with idle load gauges. It costs almost nothing, so what the router adds is not
hidden under a model's own latency. The client is a raw asyncio HTTP/1.1 client on kept-alive
connections, for the same reason.

1. Added latency: `--streams` clients loop on streaming requests, directly to the stand-in and through the
   router, interleaved (A B A B), once with their starts staggered over one response's length (independent
   clients: requests reach the router spread out) and once all started together (lockstep: every response
   lasts as long, so each round of requests reaches the router as one burst of `--streams`, which its one
   event loop takes in turn); the time to the first SSE event is compared (p50, p99 of each, and their
   differences, medians over the rounds), and split: the first request on each client connection (a new
   connection to the router, which may open a new one to the pod) against the later ones; the
   connections the router opened to the pod in each round come from its own counter. `--baseline-args`
   measures a second router with other flags in the same rounds (e.g. `--backend-keep-alive-timeout 3`,
   the 3 s pool the router once kept, which opened a connection for every stream of every round), and
   `--baseline-checkout DIR` a router from another checkout (`git worktree add DIR COMMIT`): old code, new code.
   The router's own histogram of what it adds is printed too.
   The router is pinned to one core (taskset) and the stand-ins and this client to the others, so that
   the router's work and the load generator's do not queue behind each other.
2. Throughput: the router pinned to one core takes non-streaming requests from `--rps-clients`
   closed-loop clients for `--seconds`; completed requests/s, beside the stand-in's rate when hit directly
   (which shows the router, not the stand-in or the client, is the bottleneck).
   Both parts also read the router's CPU time (/proc): per streamed request, and requests per CPU-second,
   which is what a core of its own carries, however long the router waited for its core on a busy machine.

    python benchmarks/router_overhead.py            # defaults: 100 streams, 4 rounds
    python benchmarks/router_overhead.py --baseline-args "--backend-keep-alive-timeout 3"
    git worktree add /tmp/before HEAD~1 && python benchmarks/router_overhead.py --baseline-checkout /tmp/before
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

EVENT = b'data: {"id":"cmpl-standin","object":"text_completion","choices":[{"index":0,"text":" tok"}]}\n\n'
METRICS = (b"vllm:num_requests_waiting 0.0\nvllm:num_requests_running 0.0\nvllm:kv_cache_usage_perc 0.0\n"
           b"iterserve:draining 0.0\n")
REQUEST = (b"POST /v1/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
           b"content-length: %d\r\n\r\n%s")


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def next_request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
    """The stand-in's side of a connection: the head of its next request that is not a scrape (its body
    read and dropped); a GET /metrics is answered here, with idle load gauges."""
    while True:
        head = await reader.readuntil(b"\r\n\r\n")
        length = re.search(rb"content-length: *(\d+)", head, re.I)
        if length:
            await reader.readexactly(int(length.group(1)))
        if not head.startswith(b"GET /metrics"):
            return head
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: %d\r\n\r\n%s"
                     % (len(METRICS), METRICS))


async def stand_in(port: int, events: int, itl: float) -> None:
    async def handle(reader, writer):
        try:
            while True:
                await next_request(reader, writer)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"transfer-encoding: chunked\r\n\r\n")
                for i in range(events):
                    if i and itl:
                        await asyncio.sleep(itl)
                    writer.write(_chunk(EVENT))
                writer.write(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


async def _one(reader, writer, body: bytes) -> float:
    """One request on a kept-alive connection: seconds to the first SSE event."""
    start = time.perf_counter()
    writer.write(REQUEST % (len(body), body))
    buf, first = b"", None
    while True:
        data = await reader.read(65536)
        if not data:
            raise ConnectionError("closed mid-response")
        buf += data
        if len(buf) >= 12 and not buf.startswith(b"HTTP/1.1 200"):  # an error (503 no_pods) is no stream
            raise RuntimeError(f"answered {buf[:300]!r}")
        if first is None and b"data:" in buf:
            first = time.perf_counter() - start
        if buf.endswith(b"0\r\n\r\n") and b"[DONE]" in buf:
            return first


async def load(url_port: int, clients: int, seconds: float, body: bytes, spread: float = 0.0, seed: int = 0
               ) -> tuple[list[float], list[float]]:
    """`clients` closed-loop connections for `seconds`: the first-event times of the first request on each
    connection, and of the later ones (a new connection through the router may mean a new one to the pod).
    `spread`: each client starts at a random instant within that many seconds (seeded), not all at once."""
    first: list[float] = []
    later: list[float] = []
    deadline = time.perf_counter() + seconds
    rng = random.Random(seed)
    starts = [rng.uniform(0, spread) for _ in range(clients)]

    async def client(delay: float):
        await asyncio.sleep(delay)
        reader, writer = await asyncio.open_connection("127.0.0.1", url_port)
        try:
            first.append(await _one(reader, writer, body))
            while time.perf_counter() < deadline:
                later.append(await _one(reader, writer, body))
        finally:
            writer.close()

    await asyncio.gather(*(client(delay) for delay in starts))
    return first, later


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], port: int, cpu: str | None = None, checkout: str | None = None) -> subprocess.Popen:
    """`cmd`, once it answers /metrics; its output goes to a temporary file, shown if it fails.
    `checkout`: the root of another checkout of iterserve, whose code `cmd` runs instead."""
    if cpu is not None:
        cmd = ["taskset", "-c", cpu, *cmd]
    log = tempfile.TemporaryFile()
    env = os.environ | {"PYTHONPATH": checkout} if checkout else None
    # (run from there: `-m` puts the working directory first on the path, and each checkout's root holds
    # the `iterserve` package that finds the code beside it)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=checkout)
    proc.log = log  # type: ignore[attr-defined]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"{cmd} did not start")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of `pid` so far: on a shared machine, what the router's work cost, however
    long it waited for its core."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def upstream_connections(port: int) -> float:
    """The connections the router has opened to its pods so far (its own counter)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    return sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
               if line.startswith("iterserve:router_upstream_connections_total"))


def router_histogram(port: int) -> str:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    lines = [line for line in text.splitlines() if line.startswith("iterserve:router_added_latency_seconds_")]
    return "\n".join("    " + line for line in lines if "_sum" in line or "_count" in line or
                     any(f'le="{b}"' in line for b in ("0.0005", "0.001", "0.002", "0.005", "0.01", "0.02", "0.05")))


def stats(first: list[float], later: list[float]) -> dict[str, float]:
    every = first + later
    return {"p50": pct(every, .5), "p99": pct(every, .99), "first_p99": pct(first, .99),
            "later_p99": pct(later, .99), "n": len(every)}


def describe(row: dict[str, dict[str, float]]) -> str:
    """One round's (or the medians') figures: direct, then each router's with what it adds, in ms."""
    d = row["direct"]
    out = [f"direct p50 {d['p50'] * 1e3:.2f} p99 {d['p99'] * 1e3:.2f}"]
    for label, r in row.items():
        if label != "direct":
            out.append(f"{label} p50 {r['p50'] * 1e3:.2f} p99 {r['p99'] * 1e3:.2f}, added p50 "
                       f"{(r['p50'] - d['p50']) * 1e3:.2f} p99 {(r['p99'] - d['p99']) * 1e3:.2f} (first request on a "
                       f"connection p99 {r['first_p99'] * 1e3:.2f} vs {d['first_p99'] * 1e3:.2f} direct; later "
                       f"ones {r['later_p99'] * 1e3:.2f} vs {d['later_p99'] * 1e3:.2f}; {r['opened']:.0f} new "
                       "connections to the pod)")
    return " | ".join(out) + " ms"


def stream_rounds(args, up_port: int, routers: dict[str, tuple[subprocess.Popen, int]]) -> None:
    """Added latency to the first SSE event: each round runs direct, then through each router (A B A B:
    drift on a shared machine hits every side alike), once per arrival pattern; per round, medians, and
    each router's CPU time."""
    body = b'{"model": "m", "prompt": "hello", "max_tokens": 32, "stream": true}'
    spreads = {"lockstep": 0.0, "staggered": args.events * args.itl}  # staggered: over one response's length
    rows: dict[str, list[dict[str, dict[str, float]]]] = {mode: [] for mode in args.arrivals}
    cpu = dict.fromkeys(routers, 0.0)
    for r in range(args.rounds):
        for mode in args.arrivals:
            spread = spreads[mode]
            row = {"direct": stats(*asyncio.run(load(up_port, args.streams, args.seconds, body, spread, r)))}
            for label in (list(routers) if r % 2 == 0 else list(routers)[::-1]):  # each router first in turn
                proc, port = routers[label]
                before, opened = cpu_seconds(proc.pid), upstream_connections(port)
                row[label] = stats(*asyncio.run(load(port, args.streams, args.seconds, body, spread, r)))
                cpu[label] += cpu_seconds(proc.pid) - before
                row[label]["opened"] = upstream_connections(port) - opened
            rows[mode].append(row)
            print(f"round {r}, {mode}: {describe(row)}")
    for mode, mode_rows in rows.items():
        med = {side: {k: statistics.median(row[side][k] for row in mode_rows) for k in mode_rows[0][side]}
               for side in mode_rows[0]}
        print(f"median over rounds, {args.streams} streams, {mode}: {describe(med)}")
    runs = args.rounds * len(args.arrivals)
    for label, (_, port) in routers.items():
        streamed = sum(row[label]["n"] for mode_rows in rows.values() for row in mode_rows)
        print(f"{label}: new connections to the pod by round "
              f"{[int(row[label]['opened']) for mode_rows in rows.values() for row in mode_rows]}; CPU "
              f"{cpu[label] / (runs * args.seconds) * 100:.0f}% of a core, {cpu[label] / streamed * 1e6:.0f} us "
              f"per streamed request ({args.events + 1} chunks relayed each); its own added-latency histogram "
              f"(seconds):\n{router_histogram(port)}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stand-in", type=int, metavar="PORT", help=argparse.SUPPRESS)
    p.add_argument("--streams", type=int, default=100)
    p.add_argument("--events", type=int, default=32, help="SSE events per stand-in response")
    p.add_argument("--itl", type=float, default=0.02, help="seconds between the stand-in's events")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--arrivals", default="staggered,lockstep", type=lambda v: v.split(","),
                   help="how the streams start, each measured in every round: 'staggered' (each at a random instant "
                        "within one response's length, as independent clients would) and 'lockstep' (all at once, "
                        "so every response ends, and the next request arrives, in one burst of --streams)")
    p.add_argument("--seconds", type=float, default=8.0, help="length of each measured run")
    p.add_argument("--rps-clients", type=int, default=32)
    p.add_argument("--router-args", default="", help="more `iterserve router` flags for the router measured")
    p.add_argument("--baseline-args", default=None,
                   help="also measure a second router with these flags, interleaved in the same rounds (e.g. "
                        "'--backend-keep-alive-timeout 3', the pool the router kept before)")
    p.add_argument("--baseline-checkout", default=None,
                   help="run the baseline router from another checkout's root (e.g. `git worktree add DIR COMMIT`), "
                        "to compare code, not flags")
    p.add_argument("--router-cpu", default="0", help="the core the router is pinned to (taskset -c)")
    p.add_argument("--load-cpus", default=None,
                   help="the cores of the stand-ins and this client (taskset -c list; default: all but the router's)")
    args = p.parse_args()
    if args.stand_in:
        asyncio.run(stand_in(args.stand_in, args.events, args.itl))
        return 0

    router_cpus = {int(c) for c in args.router_cpu.split(",")}
    load_cpus = ({int(c) for c in args.load_cpus.split(",")} if args.load_cpus else
                 os.sched_getaffinity(0) - router_cpus) or os.sched_getaffinity(0)
    os.sched_setaffinity(0, load_cpus)  # this client; the stand-ins inherit it
    up_port, fast_port = free_port(), free_port()
    me = [sys.executable, os.path.abspath(__file__)]
    router = [sys.executable, "-m", "iterserve.server.entrypoints.cli", "router", "--log-level", "warning",
              "--host", "127.0.0.1"]
    procs = [start([*me, "--stand-in", str(up_port), "--events", str(args.events), "--itl", str(args.itl)], up_port),
             start([*me, "--stand-in", str(fast_port), "--events", "1", "--itl", "0"], fast_port)]
    try:
        flags = {"router": args.router_args} | ({"baseline": args.baseline_args or ""}
                                                 if args.baseline_args is not None or args.baseline_checkout else {})
        routers, fast_routers = {}, {}  # in front of the streaming stand-in, and of the one-event one
        for label, extra in flags.items():
            for into, upstream in ((routers, up_port), (fast_routers, fast_port)):
                port = free_port()
                procs.append(start([*router, *extra.split(), "--port", str(port), "--endpoints",
                                    f"http://127.0.0.1:{upstream}"], port, args.router_cpu,
                                   args.baseline_checkout if label == "baseline" else None))
                into[label] = (procs[-1], port)
        print(f"# router_overhead: {args.streams} concurrent streams of {args.events} SSE events {args.itl * 1e3:g} ms "
              f"apart from a STAND-IN upstream; {args.rounds} interleaved rounds of {args.seconds:g} s; routers "
              f"{ {label: extra or '(defaults)' for label, extra in flags.items()} } pinned to cpu {args.router_cpu}, "
              f"stand-ins and client to {sorted(load_cpus)}; {os.cpu_count()} cpus on this machine, load average "
              f"{os.getloadavg()[0]:.1f} at the start (other work shares them: compare only within one run); "
              "latencies to the first SSE event")
        stream_rounds(args, up_port, routers)

        one = b'{"model": "m", "prompt": "hello", "max_tokens": 1}'
        rates: dict[str, list[tuple[float, float, float]]] = {label: [] for label in fast_routers}
        for r in range(2):
            direct = sum(asyncio.run(load(fast_port, args.rps_clients, args.seconds, one)), [])
            for label in (list(fast_routers) if r % 2 == 0 else list(fast_routers)[::-1]):
                proc, port = fast_routers[label]
                before = cpu_seconds(proc.pid)
                routed = sum(asyncio.run(load(port, args.rps_clients, args.seconds, one)), [])
                used = cpu_seconds(proc.pid) - before
                rates[label].append((len(direct) / args.seconds, len(routed) / args.seconds, len(routed) / used))
        for label, runs in rates.items():
            d, rate, per_cpu = (statistics.median(c) for c in zip(*runs, strict=True))
            print(f"throughput, {label}, {args.rps_clients} closed-loop clients, one-event responses: router on one "
                  f"core {rate:.0f} requests/s; the stand-in hit directly {d:.0f} requests/s (ratio {d / rate:.1f}x); "
                  f"{per_cpu:.0f} requests per second of the router's CPU time (a core of its own would carry that)")
    finally:
        for proc in procs:
            if proc.poll() is not None:  # it died during the run: say why
                proc.log.seek(0)
                print(f"{proc.args} exited with {proc.returncode}:\n{proc.log.read()[-4000:].decode()}",
                      file=sys.stderr)
            proc.terminate()
        for proc in procs:
            proc.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
