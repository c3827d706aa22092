"""How long `iterserve serve` takes from its start to a 200 on /ready, and the CPU it spends on the way.

A scale-out is only as fast as the new pod's start, and a new pod starts on a node whose cores are busy
serving: there its start-up takes as long as its CPU-seconds at the share of a core it gets. So both are
measured, idle and beside `--busy` processes that spin on a core each (a node under load), in turns
(idle, busy, idle, busy, ...), and printed per round with their medians, beside the resident memory of
the server's process and of its engine core's when /ready answers.

`--base DIR` also starts the code of another checkout (say `git worktree add /tmp/base HEAD~1`, or
`git archive REF | tar -x -C DIR`), in turns with this one (base, this, base, this, ...), each as
`python -m iterserve.server.entrypoints.cli serve` run from its own tree.

    python benchmarks/startup.py                    # the bundled model, 5 rounds, idle and beside 2 spinners
    python benchmarks/startup.py --rounds 3 --busy 0,2,4
    python benchmarks/startup.py --rounds 3 --base /tmp/base
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
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
ROOT = Path(__file__).resolve().parents[1]


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


def rss_mib(pid: int) -> float:
    """Resident memory of `pid`, in MiB (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    except (FileNotFoundError, ProcessLookupError, StopIteration):
        return 0.0
    return kib / 1024


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


def one_start(tree: Path, model: str | None, threads: int, timeout_s: float) -> tuple[float, float, float, float]:
    """(seconds to /ready, CPU-seconds of the server and its core by then, the server's and the core's
    resident MiB then) of one fresh server of the code in `tree`."""
    port = free_port()
    argv = [sys.executable, "-m", "iterserve.server.entrypoints.cli", "serve", "--host", "127.0.0.1",
            "--port", str(port), "--threads", str(threads), "--log-level", "warning"]
    if model:
        argv += ["--model", model]
    env = {**os.environ, "PYTHONPATH": str(tree)}  # the tree's `iterserve` before the installed one
    start = time.monotonic()
    proc = subprocess.Popen(argv, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not ready(port):
            if proc.poll() is not None:
                raise RuntimeError(f"iterserve serve exited with {proc.returncode} before it was ready")
            if time.monotonic() - start > timeout_s:
                raise RuntimeError(f"not ready after {timeout_s:.0f} s")
            time.sleep(0.05)
        wall, cpu = time.monotonic() - start, cpu_seconds(proc.pid)
        return wall, cpu, rss_mib(proc.pid), sum(rss_mib(c) for c in children(proc.pid))
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="what `serve --model` gets (default: the bundled model)")
    ap.add_argument("--threads", type=int, default=1, help="`serve --threads` (the live benchmark's pods: 1)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--busy", default="0,2", help="spinning processes beside the start, one case each")
    ap.add_argument("--base", type=Path, default=None, help="a checkout of the code to compare, run in turns")
    ap.add_argument("--timeout-s", type=float, default=180.0)
    args = ap.parse_args(argv)
    cases = [int(n) for n in args.busy.split(",")]
    trees = {"base": args.base.resolve(), "this": ROOT} if args.base else {"this": ROOT}
    results: dict[tuple[str, int], list[tuple[float, float, float, float]]] = {
        (t, n): [] for t in trees for n in cases}
    print(f"iterserve serve --threads {args.threads}, model {args.model or 'bundled'}; "
          f"{os.cpu_count()} CPUs; {args.rounds} rounds of {cases} spinning processes, in turns; "
          + ", ".join(f"{t}: {path}" for t, path in trees.items()), flush=True)
    for r in range(args.rounds):
        for n in cases:
            for name, tree in trees.items():
                spinners = [multiprocessing.Process(target=spin, daemon=True) for _ in range(n)]
                for s in spinners:
                    s.start()
                try:
                    result = one_start(tree, args.model, args.threads, args.timeout_s)
                finally:
                    for s in spinners:
                        s.kill()
                        s.join()
                results[name, n].append(result)
                wall, cpu, server_mib, core_mib = result
                print(f"  round {r + 1}, {n} spinning, {name}: ready after {wall:5.2f} s, {cpu:5.2f} CPU-s, "
                      f"RSS server {server_mib:4.0f} MiB, core {core_mib:4.0f} MiB", flush=True)
    print("| code | spinning processes | ready after (median) | CPU-s to ready (median) "
          "| server RSS, MiB (median) | core RSS, MiB (median) | rounds |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for (name, n), rows in results.items():
        wall, cpu, server_mib, core_mib = (statistics.median(column) for column in zip(*rows, strict=True))
        print(f"| {name} | {n} | {wall:.2f} s | {cpu:.2f} | {server_mib:.0f} | {core_mib:.0f} | {len(rows)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
