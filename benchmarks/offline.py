"""Offline throughput of iterserve against its baselines, side by side in one run.

    python benchmarks/offline.py [--threads 2] [--max-num-seqs 64] [--compare-max-num-seqs 8,16]
                                 [--hf-limit N | --skip-hf] [--out results.json]

Workload (benchmarks/offline_workload.py): 64 prompts, output lengths spread evenly over 8-256, ignore_eos,
greedy, SmolLM2-135M-Instruct in fp32. Every engine reads the same fp32 weights (the bundled GGUF
dequantized into an HF directory by prepare_model.py). Start-up is excluded everywhere. Printed:
generated tok/s of each engine and the ratios the engine-core issue targets, with KV waste and
preemptions next to them. The comparison with vLLM, at each of its configurations, is
benchmarks/peer_vllm.py.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `benchmarks.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.baseline_hf import run_hf_sequential
from benchmarks.offline_workload import make_workload
from benchmarks.prepare_model import prepare_hf_model
from benchmarks.scheduler_overhead import measure_overhead
from iterserve.server.config import EngineConfig
from iterserve.server.engine.sampling_params import SamplingParams
from iterserve.server.entrypoints.llm import LLM


def run_iterserve(workload, model_dir: Path, policy: str, max_num_seqs: int, threads: int,
                  dtype: str = "float32") -> dict:
    """Generated tok/s of one policy, start-up excluded; also returns the prompt lengths it saw."""
    t0 = time.perf_counter()
    llm = LLM(config=EngineConfig(model=str(model_dir), dtype=dtype, policy=policy,
                                  max_num_seqs=max_num_seqs, num_threads=threads, kv_cache_memory="2GiB"))
    startup = time.perf_counter() - t0
    params = [SamplingParams(max_tokens=w.max_tokens, temperature=0, ignore_eos=True) for w in workload]
    # one short warm-up generate: first-call costs (oneDNN primitives, allocator) stay out of the timing
    llm.generate(workload[0].prompt, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    stats_before = llm.engine.stats.num_steps
    start = time.perf_counter()
    outputs = llm.generate([w.prompt for w in workload], params)
    seconds = time.perf_counter() - start
    generated = sum(len(o.token_ids) for o in outputs)
    stats = llm.engine.stats
    return {
        "engine": f"iterserve-{policy}",
        "dtype": str(llm.engine.model_runner.dtype).removeprefix("torch."),
        "max_num_seqs": max_num_seqs,
        "num_requests": len(outputs),
        "prompt_tokens": sum(len(o.prompt_token_ids) for o in outputs),
        "generated_tokens": generated,
        "seconds": seconds,
        "generated_tok_per_s": generated / seconds,
        "startup_s": startup,
        "steps": stats.num_steps - stats_before,
        "preemptions": stats.num_preemptions,
        "kv_waste": stats.kv_waste,
        "prompt_lens": [len(o.prompt_token_ids) for o in outputs],
    }


def kv_waste_by_block_size(prompt_lens: list[int], output_lens: list[int], max_num_seqs: int,
                           block_sizes=(8, 16, 32)) -> dict[int, float]:
    """KV waste of the same schedule at other block sizes: the schedule depends only on token counts
    (ignore_eos), so a model-free engine replays it exactly."""
    from iterserve.common.wire import Knobs
    from iterserve.server.engine.llm_engine import LLMEngine
    from iterserve.server.runner.null_runner import NullModelRunner

    waste = {}
    for bs in block_sizes:
        engine = LLMEngine(NullModelRunner(bs, prepare_inputs=False), tokenizer=None, max_model_len=8192,
                           num_blocks=2**20 // bs, block_size=bs,
                           knobs=Knobs(max_num_seqs=max_num_seqs), vocab_size=1000)
        for p, n in zip(prompt_lens, output_lens, strict=True):
            engine.add_request(prompt_token_ids=[1] * p,
                               sampling_params=SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        waste[bs] = engine.stats.kv_waste
    return waste


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-num-seqs", type=int, default=64, help="continuous policy's batch cap")
    ap.add_argument("--compare-max-num-seqs", default="8,16",
                    help="batch caps at which continuous and static run side by side (comma-separated)")
    ap.add_argument("--hf-limit", type=int, default=None, help="run HF on the first N requests only")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--out", default=None, help="write every figure to this JSON file")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    workload = make_workload()
    model_dir = prepare_hf_model()
    results: dict[str, dict] = {}

    def report(key: str, r: dict) -> None:
        results[key] = r
        extra = f"  waste {r['kv_waste']:.1%}  preemptions {r['preemptions']}" if "kv_waste" in r else ""
        print(f"{key:<28} {r['generated_tok_per_s']:8.1f} gen tok/s  ({r['generated_tokens']} tokens, "
              f"{r['num_requests']} requests, {r['seconds']:.1f} s){extra}", flush=True)

    report("continuous", run_iterserve(workload, model_dir, "continuous", args.max_num_seqs, args.threads))
    caps = [int(c) for c in args.compare_max_num_seqs.split(",")]
    for n in caps:
        report(f"continuous@{n}", run_iterserve(workload, model_dir, "continuous", n, args.threads))
        report(f"static@{n}", run_iterserve(workload, model_dir, "static", n, args.threads))
    if not args.skip_hf:
        report("hf-sequential", run_hf_sequential(workload, model_dir, num_threads=args.threads, limit=args.hf_limit))
    results["scheduler_overhead"] = overhead = measure_overhead(num_running=256)
    results["kv_waste_by_block_size"] = waste = kv_waste_by_block_size(
        results["continuous"]["prompt_lens"], [w.max_tokens for w in workload], args.max_num_seqs)

    best = results["continuous"]["generated_tok_per_s"]
    print("\nratios (target)")
    for n in caps:
        ratio = results[f"continuous@{n}"]["generated_tok_per_s"] / results[f"static@{n}"]["generated_tok_per_s"]
        steps = results[f"static@{n}"]["steps"] / results[f"continuous@{n}"]["steps"]
        print(f"  continuous / static @ {n} seqs:   {ratio:.2f}x  (>= 2x; static needs {steps:.2f}x the steps)")
    if "hf-sequential" in results:
        ratio = best / results['hf-sequential']['generated_tok_per_s']
        print(f"  iterserve / HF one at a time:    {ratio:.1f}x  (>= 15x)")
    print(f"  scheduler + input prep per step @ 256 running: {overhead['schedule_and_prepare_ms_median']:.3f} ms "
          f"(<= 1 ms); whole engine step without a model: {overhead['engine_step_ms_median']:.3f} ms")
    print("  KV waste by block size (same schedule): "
          + ", ".join(f"{bs}: {w:.1%}" for bs, w in waste.items()) + "  (< 4%)")
    results["machine"] = {"cpu": platform.processor() or platform.machine(), "threads": args.threads,
                          "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
