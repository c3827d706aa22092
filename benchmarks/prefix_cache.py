"""Prefix caching served: iterserve with it on and off, and vLLM's CPU build with it on, on the shared-prefix
workloads of `iterserve bench` (a long system prompt + short questions; multi-turn conversations
resending their history), same seeded load, same machine.

    python benchmarks/prefix_cache.py [--repeats 2] [--requests 24] [--concurrency 4] [--prefix-len 1024]
                                      [--num-prefixes 2] [--num-turns 4] [--max-model-len 2048] [--threads 2]
                                      [--dtype auto|float32|bfloat16] [--iterserve-configs on,off]
                                      [--vllm-configs eager,compiled]
                                      [--out F.json]

Each round starts each server in turn (iterserve on, iterserve off, every vLLM configuration; C B A every
other round), runs both workloads against it, one after the other, and stops it, so no idle server shares the CPU
with a measured one. Printed: every run, then medians over the rounds of TTFT p50/p99 and output tok/s,
each server's prefix cache hit rate (vllm:prefix_cache_hits / _queries, scraped from its /metrics before
and after the workload) beside the workload's theoretical maximum (`max_prefix_hits`: every earlier
prompt's whole blocks findable), and the ratios: caching on vs off, and iterserve vs vLLM's best
configuration (its highest median output tok/s).

vLLM comes from the venv that `python benchmarks/peer_vllm.py --install` makes; the servers are started
and stopped by benchmarks/peer_served.py's `Server`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `benchmarks.*`, run as a file

from benchmarks.peer_served import VLLM_SERVED_CONFIGS, Server, figure  # noqa: E402
from benchmarks.peer_vllm import INSTALLED_MARKER  # noqa: E402
from benchmarks.prepare_model import prepare_hf_model  # noqa: E402
from iterserve.bench.load import BenchConfig, run_bench  # noqa: E402
from iterserve.bench.shared_prefix import max_prefix_hits  # noqa: E402
from iterserve.bench.workload import WorkloadSpec, generate_requests  # noqa: E402

WORKLOADS = ("system-prompt", "multi-turn")
BLOCK_SIZE = 16  # iterserve's and vLLM's default
FIGURES = (("TTFT p50", ("ttft_ms", "p50")), ("TTFT p99", ("ttft_ms", "p99")), ("out tok/s", ("output_throughput",)))


def prefix_counters(url: str) -> tuple[float, float]:
    """(vllm:prefix_cache_queries_total, vllm:prefix_cache_hits_total) from a server's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    found = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in family.samples:
            if s.name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
                found[s.name] = found.get(s.name, 0.0) + s.value
    return found.get("vllm:prefix_cache_queries_total", 0.0), found.get("vllm:prefix_cache_hits_total", 0.0)


def workload_spec(shape: str, args) -> WorkloadSpec:
    return WorkloadSpec(shape, seed=args.seed, prefix_len=args.prefix_len, num_prefixes=args.num_prefixes,
                        num_turns=args.num_turns, max_model_len=args.max_model_len)


def theoretical_hit_rate(shape: str, args) -> float:
    prompts = [r.prompt_ids for r in generate_requests(workload_spec(shape, args), args.requests)]
    queries, hits = max_prefix_hits(prompts, BLOCK_SIZE)
    return hits / queries


def measure(name: str, args, model_dir: Path, log_dir: Path) -> dict:
    if name.startswith("iterserve"):
        extra = ["--no-enable-prefix-caching"] if name == "iterserve off" else ["--enable-prefix-caching"]
        server = Server("iterserve", model_dir, args.max_model_len, args.threads, log_dir, extra, dtype=args.dtype)
    else:
        server = Server(name, model_dir, args.max_model_len, args.threads, log_dir, [],
                        vllm_args=["--enable-prefix-caching"], dtype=args.dtype)
    results = {}
    try:
        server.wait_ready()
        for shape in WORKLOADS:
            before = prefix_counters(server.url)
            summary = run_bench(BenchConfig(url=server.url, workload=workload_spec(shape, args),
                                            num_requests=args.requests, concurrency=args.concurrency)
                                ).runs[0].summary(None)
            after = prefix_counters(server.url)
            queries, hits = after[0] - before[0], after[1] - before[1]
            summary["hit_rate"] = hits / queries if queries else 0.0
            results[shape] = summary
    finally:
        server.stop()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--requests", type=int, default=24, help="requests per workload and run")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--num-prefixes", type=int, default=2)
    ap.add_argument("--num-turns", type=int, default=4)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                    help="both servers' --dtype; auto: each engine's own default (bf16 on CPUs with native bf16)")
    ap.add_argument("--iterserve-configs", default="on,off",
                    help="comma list of on,off: iterserve with prefix caching on and/or off (on is required)")
    ap.add_argument("--vllm-configs", default=",".join(VLLM_SERVED_CONFIGS),
                    help=f"comma list of {','.join(VLLM_SERVED_CONFIGS)}; "
                                                              "empty: no vLLM")
    ap.add_argument("--out", help="write every run's summaries to this JSON file")
    args = ap.parse_args()
    vllm_names = [f"vllm {c}" for c in args.vllm_configs.split(",") if c]
    if vllm_names and not INSTALLED_MARKER.exists():
        sys.exit("no vLLM venv: run `python benchmarks/peer_vllm.py --install` first, or pass --vllm-configs ''")

    model_dir = prepare_hf_model()
    iterserve_names = [f"iterserve {c}" for c in args.iterserve_configs.split(",") if c]
    if "iterserve on" not in iterserve_names or not set(iterserve_names) <= {"iterserve on", "iterserve off"}:
        sys.exit("--iterserve-configs: a comma list of on,off that includes on")
    names = [*iterserve_names, *vllm_names]
    best_rates = {shape: theoretical_hit_rate(shape, args) for shape in WORKLOADS}
    runs: dict[str, list[dict]] = {n: [] for n in names}
    print(f"{args.requests} requests per workload at concurrency {args.concurrency}; prefix {args.prefix_len} "
          f"tokens, {args.num_prefixes} prefixes, {args.num_turns} turns; seed {args.seed}; max_model_len "
          f"{args.max_model_len}, dtype {args.dtype}, {args.threads} threads", flush=True)
    with tempfile.TemporaryDirectory(prefix="iterserve-prefix-cache-") as tmp:
        for round_no in range(1, args.repeats + 1):
            for name in names if round_no % 2 else names[::-1]:  # reversed every other round: drift favours none
                r = measure(name, args, model_dir, Path(tmp))
                runs[name].append(r)
                for shape in WORKLOADS:
                    s = r[shape]
                    line = "  ".join(f"{label} {figure(s, path):8.1f}" for label, path in FIGURES)
                    print(f"  round {round_no}  {name:<14} {shape:<14} {line}  hit rate {s['hit_rate']:.2f}  "
                          f"(failed {s['num_failed']})", flush=True)

    med = {(n, shape): {label: statistics.median(figure(r[shape], path) for r in rs) for label, path in FIGURES}
           for n, rs in runs.items() for shape in WORKLOADS}
    for (n, shape), m in med.items():
        m["hit rate"] = statistics.median(r[shape]["hit_rate"] for r in runs[n])
    print(f"\nmedians over {args.repeats} rounds (latencies in ms); theoretical hit rates: "
          + ", ".join(f"{shape} {rate:.2f}" for shape, rate in best_rates.items()))
    labels = [label for label, _ in FIGURES] + ["hit rate"]
    print(f"  {'':<30}" + "".join(f"{label:>12}" for label in labels))
    for shape in WORKLOADS:
        for n in names:
            print(f"  {n + ' / ' + shape:<30}" + "".join(f"{med[n, shape][label]:12.2f}" for label in labels))
    best = max(vllm_names, key=lambda n: sum(med[n, s]["out tok/s"] for s in WORKLOADS), default=None)
    for shape in WORKLOADS:
        on = med["iterserve on", shape]
        if "iterserve off" in runs:
            off = med["iterserve off", shape]
            print(f"  {shape}: caching on vs off: TTFT p50 {off['TTFT p50'] / on['TTFT p50']:.2f}x lower, "
                  f"p99 {off['TTFT p99'] / on['TTFT p99']:.2f}x lower, "
                  f"out tok/s {on['out tok/s'] / off['out tok/s']:.2f}x")
        print(f"  {shape}: hit rate {on['hit rate']:.2f} of at most {best_rates[shape]:.2f}")
        if best is not None:
            theirs = med[best, shape]
            print(f"  {shape}: iterserve on / {best}: out tok/s {on['out tok/s'] / theirs['out tok/s']:.2f}x, "
                  f"TTFT p50 {on['TTFT p50'] / theirs['TTFT p50']:.2f}x (their hit rate {theirs['hit rate']:.2f})")
    print("  targets: system-prompt TTFT p50 >= 5x lower on vs off; vs vLLM out tok/s >= 1.25x, TTFT p50 <= 1.00x")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "args": vars(args), "date": time.strftime("%Y-%m-%d"), "theoretical_hit_rate": best_rates,
            "medians": {f"{n} / {s}": m for (n, s), m in med.items()}, "best_vllm": best, "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
