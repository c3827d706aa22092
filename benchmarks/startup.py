"""How long `iterserve serve` takes from its start to a 200 on /ready, and the CPU it spends on the way.

A scale-out is only as fast as the new pod's start, and a new pod starts on a node whose cores are busy
serving: there its start-up takes as long as its CPU-seconds at the share of a core it gets. So both are
measured, idle and beside `--busy` processes that spin on a core each (a node under load), in turns
(idle, busy, idle, busy, ...), and printed per round with their medians.

    python benchmarks/startup.py                    # the bundled model, 5 rounds, idle and beside 2 spinners
    python benchmarks/startup.py --rounds 3 --busy 0,2,4
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def spin() -> None:
    while True:
        pass


def cpu_seconds(pid: int) -> float:
    """User + system CPU of `pid` and of its live children (the engine core), from /proc."""
    total = 0.0
    for p in [pid, *children(pid)]:
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime
        except (FileNotFoundError, ProcessLookupError):
            pass
    return total


def children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except FileNotFoundError:
        return []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


def one_start(model: str | None, threads: int, timeout_s: float) -> tuple[float, float]:
    """(seconds to /ready, CPU-seconds of the server and its core by then) of one fresh server."""
    port = free_port()
    argv = [os.path.join(os.path.dirname(sys.executable), "iterserve"), "serve", "--host", "127.0.0.1",
            "--port", str(port), "--threads", str(threads), "--log-level", "warning"]
    if model:
        argv += ["--model", model]
    start = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not ready(port):
            if proc.poll() is not None:
                raise RuntimeError(f"iterserve serve exited with {proc.returncode} before it was ready")
            if time.monotonic() - start > timeout_s:
                raise RuntimeError(f"not ready after {timeout_s:.0f} s")
            time.sleep(0.05)
        return time.monotonic() - start, cpu_seconds(proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="what `serve --model` gets (default: the bundled model)")
    ap.add_argument("--threads", type=int, default=1, help="`serve --threads` (the live benchmark's pods: 1)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--busy", default="0,2", help="spinning processes beside the start, one case each")
    ap.add_argument("--timeout-s", type=float, default=180.0)
    args = ap.parse_args(argv)
    cases = [int(n) for n in args.busy.split(",")]
    results: dict[int, list[tuple[float, float]]] = {n: [] for n in cases}
    print(f"iterserve serve --threads {args.threads}, model {args.model or 'bundled'}; "
          f"{os.cpu_count()} CPUs; {args.rounds} rounds of {cases} spinning processes, in turns", flush=True)
    for r in range(args.rounds):
        for n in cases:
            spinners = [multiprocessing.Process(target=spin, daemon=True) for _ in range(n)]
            for s in spinners:
                s.start()
            try:
                wall, cpu = one_start(args.model, args.threads, args.timeout_s)
            finally:
                for s in spinners:
                    s.kill()
                    s.join()
            results[n].append((wall, cpu))
            print(f"  round {r + 1}, {n} spinning: ready after {wall:5.2f} s, {cpu:5.2f} CPU-s", flush=True)
    print("| spinning processes | ready after (median) | CPU-s to ready (median) | rounds |")
    print("|---:|---:|---:|---:|")
    for n in cases:
        walls, cpus = zip(*results[n], strict=True)
        print(f"| {n} | {statistics.median(walls):.2f} s | {statistics.median(cpus):.2f} | {len(walls)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
