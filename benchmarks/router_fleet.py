"""What the router's policies buy over round-robin, live: two iterserve servers behind `iterserve router`.

    python benchmarks/router_fleet.py [--rounds 2] [--requests 60] [--rate 1.0] [--seed 5]
                                      [--workloads mixed,shared-mix]
                                      [--policies round-robin,least-requests,least-load,prefix-hash]
                                      [--threads 1] [--max-model-len 2048] [--out F.json]

Two real `iterserve serve` processes on loopback (the bundled SmolLM2-135M, `--threads` each) stay up
for the whole run. For every workload, each round runs every policy in turn, in reverse order every
other round (A B C, C B A): it starts the real `iterserve router --endpoints <both> --policy P` (or a
`label=router args` entry's arguments), empties both servers' prefix caches (POST
/admin/reset_prefix_cache) so that every run starts from the same state, drives the same seeded
open-loop Poisson `iterserve bench` load through the router, and stops the router. `round-robin` is what a
Kubernetes Service gives; running it through the same router makes the policy the only difference, the
router's own cost being the same on every side. `least-requests` is least-load without the pending
prompt tokens (router/policy.py).

The default workloads make the pods' loads diverge: `mixed` (chat turns, long summaries, long generations:
a round-robin pod can get two long prompts in a row while the other idles) and `shared-mix` (system
prompts and conversations sharing long prefixes, which prefix-hash keeps on the pod that caches them).
Pick `--rate` near the pair's capacity: far below it every policy finds idle pods, far above it every
queue grows without bound; and enough `--requests` that the p99 is not the one longest prompt's own
prefill (mixed's 2,016-token summary takes ~2 s on one thread with nothing ahead of it, whatever the
policy). Printed: every run, then per workload the medians over rounds of TTFT and TPOT p50/p99 and
output tok/s, round-robin's p99 TTFT over each policy's, and the requests each pod got in each round (the
bench's model list and probe included).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `benchmarks.*`, run as a file

from benchmarks.peer_served import Server, _free_port, _tail, stop_session  # noqa: E402
from benchmarks.prepare_model import prepare_hf_model  # noqa: E402
from iterserve.bench.load import BenchConfig, run_bench  # noqa: E402
from iterserve.bench.workload import SHAPES, WorkloadSpec, parse_length  # noqa: E402

POLICIES = ("round-robin", "least-requests", "least-load", "prefix-hash")
BASELINE = "round-robin"
FIGURES = (("TTFT p50", ("ttft_ms", "p50")), ("TTFT p99", ("ttft_ms", "p99")), ("TPOT p50", ("tpot_ms", "p50")),
           ("TPOT p99", ("tpot_ms", "p99")), ("out tok/s", ("output_throughput",)))


class RouterProcess:
    """The real `iterserve router` in front of `pods`, with one policy, until `stop()`."""

    def __init__(self, pods: list[str], policy: str, log_dir: Path) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        label, args = router_args(policy)
        cmd = [sys.executable, "-m", "iterserve.server.entrypoints.cli", "router", "--host", "127.0.0.1",
               "--port", str(self.port), "--endpoints", ",".join(pods), *args,
               "--drain-timeout", "0", "--log-level", "warning"]
        self.log = log_dir / f"router-{label}-{self.port}.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float = 60) -> None:
        # /ready turns 200 once a scrape found a routable pod
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the router exited ({self.proc.returncode}); log:\n{_tail(self.log)}")
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"the router was not ready after {timeout} s; log:\n{_tail(self.log)}")

    def requests_per_pod(self, pods: list[str]) -> list[int]:
        """How many requests the router relayed to each pod (its iterserve:router_requests_total)."""
        counts = dict.fromkeys(pods, 0)
        for line in httpx.get(self.url + "/metrics", timeout=5).text.splitlines():
            if line.startswith("iterserve:router_requests_total{"):
                for pod in pods:
                    if f'pod="{pod}"' in line:
                        counts[pod] += int(float(line.rsplit(" ", 1)[1]))
        return [counts[p] for p in pods]

    def stop(self) -> None:
        stop_session(self.proc, signal.SIGTERM, 15)


def router_args(policy: str) -> tuple[str, list[str]]:
    """A `--policies` entry: a policy's name, or `label=router args` (e.g. `ll128=--policy least-load
    --request-tokens 128`) to compare a policy's settings."""
    label, sep, args = policy.partition("=")
    return (label, shlex.split(args)) if sep else (policy, ["--policy", policy])


def reset_prefix_caches(pods: list[str], token: str) -> None:
    for pod in pods:
        r = httpx.post(pod + "/admin/reset_prefix_cache", headers={"Authorization": f"Bearer {token}"}, timeout=30)
        r.raise_for_status()


def measure(policy: str, workload: WorkloadSpec, args, pods: list[str], token: str, log_dir: Path) -> dict:
    router = RouterProcess(pods, policy, log_dir)
    try:
        router.wait_ready()
        reset_prefix_caches(pods, token)
        result = run_bench(BenchConfig(url=router.url, workload=workload, num_requests=args.requests,
                                       rate=args.rate, settings={"router_policy": policy}))
        per_pod = router.requests_per_pod(pods)
    finally:
        router.stop()
    return {"summary": result.runs[0].summary(None), "per_pod": per_pod}


def figure(summary: dict, path: tuple[str, ...]) -> float:
    value = summary
    for key in path:
        value = value[key]
    return float(value)


def report(workload: str, runs: dict[str, list[dict]]) -> dict:
    med = {p: {label: statistics.median(figure(r["summary"], path) for r in rs) for label, path in FIGURES}
           for p, rs in runs.items()}
    print(f"\n{workload}: medians over {len(next(iter(runs.values())))} rounds (latencies in ms)")
    print(f"  {'policy':<13}" + "".join(f"{label:>11}" for label, _ in FIGURES)
          + f"{'failed':>8}{'RR p99 / p99':>14}  per pod, each round")
    for policy, m in med.items():
        split = " ".join("/".join(map(str, r["per_pod"])) for r in runs[policy])  # every round's split
        failed = sum(r["summary"]["num_failed"] for r in runs[policy])
        ratio = (f"{med[BASELINE]['TTFT p99'] / m['TTFT p99']:13.2f}x"
                 if BASELINE in med and m["TTFT p99"] > 0 else f"{'-':>14}")
        print(f"  {policy:<13}" + "".join(f"{m[label]:11.1f}" for label, _ in FIGURES)
              + f"{failed:>8}{ratio}  {split}")
    return med


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=60, help="requests per run")
    ap.add_argument("--rate", type=float, default=1.0, help="open-loop Poisson arrivals, requests/s")
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--workloads", default="mixed,shared-mix", help="comma list of `iterserve bench` shapes")
    ap.add_argument("--policies", default=",".join(POLICIES),
                    help="comma list of policies, or `label=router args` entries; round-robin is the baseline")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each server")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--prefix-len", type=int, default=512, help="shared-prefix shapes: tokens of each prefix")
    ap.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix shapes: distinct prefixes")
    ap.add_argument("--output-len", default=None,
                    help="override every class's output length, e.g. 32 or uniform:16:128")
    ap.add_argument("--out", help="write every run's summaries to this JSON file")
    args = ap.parse_args(argv)
    policies = [p for p in args.policies.split(",") if p]
    workloads = [w for w in args.workloads.split(",") if w]
    for name in workloads:
        if name not in SHAPES or name == "jsonl":
            ap.error(f"--workloads: unknown shape {name!r}")

    output_len = parse_length(args.output_len, "--output-len") if args.output_len else None
    model_dir = prepare_hf_model()
    token = secrets.token_hex(16)
    print(f"router_fleet: 2 iterserve servers ({args.threads} thread(s) each) behind `iterserve router`; "
          f"{args.requests} requests per run, Poisson at {args.rate:g}/s, seed {args.seed}; policies "
          f"{', '.join(policies)} interleaved over {args.rounds} rounds; {os.cpu_count()} cpus, load average "
          f"{os.getloadavg()[0]:.1f} at the start (a shared machine: compare only within one run)", flush=True)
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="iterserve-router-fleet-") as tmp:
        servers = [Server("iterserve", model_dir, args.max_model_len, args.threads, Path(tmp),
                          ["--admin-token", token]) for _ in range(2)]
        try:
            for server in servers:
                server.wait_ready()
            pods = [s.url for s in servers]
            for name in workloads:
                workload = WorkloadSpec(name, seed=args.seed, prefix_len=args.prefix_len,
                                        num_prefixes=args.num_prefixes, output_len=output_len)
                runs: dict[str, list[dict]] = {router_args(p)[0]: [] for p in policies}  # by label
                for round_no in range(1, args.rounds + 1):
                    # A B C, then C B A: a machine that speeds up or slows down over the run favours no policy
                    for policy in policies if round_no % 2 else policies[::-1]:
                        r = measure(policy, workload, args, pods, token, Path(tmp))
                        who = router_args(policy)[0]
                        runs[who].append(r)
                        line = "  ".join(f"{label} {figure(r['summary'], path):7.1f}" for label, path in FIGURES)
                        print(f"  {name} round {round_no}  {who:<12} {line}  per pod "
                              f"{'/'.join(map(str, r['per_pod']))}  failed {r['summary']['num_failed']}  "
                              f"(load average {os.getloadavg()[0]:.1f})", flush=True)
                results[name] = {"medians": report(name, runs), "runs": runs}
        finally:
            for server in servers:
                server.stop()
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "date": time.strftime("%Y-%m-%d %H:%M"),
                                              "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
