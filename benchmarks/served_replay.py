"""A served load replayed in-process: the engine stepped directly, closed loop, steps split by kind.

    python benchmarks/served_replay.py [--workload mixed] [--seed 3] [--requests 120] [--concurrency 16]
                                       [--max-model-len 2048] [--threads 2] [--dtype auto]
                                       [--model DIR] [--out F.json]

The same seeded requests `iterserve bench` sends (iterserve.bench.workload), kept --concurrency at a
time: a request joins the moment another finishes, before the next step, so no step waits on HTTP, the
API process or a client. Printed: wall and CPU seconds, and the steps that carry prompt tokens apart
from the decode-only ones (count, seconds, median and p90 ms, tokens fed to the model). Set beside a
served run of the same load (`iterserve:step_duration_seconds` on the server's /metrics), it tells what
serving costs; under py-spy it tells where each kind of step spends its time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `benchmarks.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.prepare_model import prepare_hf_model  # noqa: E402
from iterserve.bench.workload import SHAPES, WorkloadSpec, generate_requests  # noqa: E402
from iterserve.server.engine.sampling_params import SamplingParams  # noqa: E402
from iterserve.server.entrypoints.llm import LLM  # noqa: E402

KINDS = ("prompt", "decode")  # steps with prompt tokens in them; steps that only decode


def replay(llm: LLM, spec: WorkloadSpec, num_requests: int, concurrency: int) -> dict:
    """Run the load to the end; returns per-kind step figures and the load's token counts."""
    engine = llm.engine
    requests = iter(generate_requests(spec, num_requests))
    expected: dict[str, int] = {}  # request id -> its max_tokens (ignore_eos: it generates exactly that)
    generated: dict[str, int] = {}
    prompt_tokens = 0

    def add_next() -> None:
        nonlocal prompt_tokens
        spec_ = next(requests, None)
        if spec_ is None:
            return
        ids = spec_.prompt_ids if spec_.prompt_ids is not None else llm.tokenizer.encode(spec_.text())
        params = SamplingParams(max_tokens=spec_.max_tokens, temperature=0.0, ignore_eos=True)
        request_id = engine.add_request(prompt_token_ids=ids, sampling_params=params)
        expected[request_id] = spec_.max_tokens
        prompt_tokens += len(ids)

    for _ in range(concurrency):
        add_next()
    steps: dict[str, list[float]] = {kind: [] for kind in KINDS}
    tokens = dict.fromkeys(KINDS, 0)
    stats = engine.stats
    wall0, cpu0 = time.perf_counter(), time.process_time()
    while engine.has_unfinished_requests():
        prompt0, gen0 = stats.num_prompt_tokens_computed, stats.num_generated_tokens
        start = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - start
        kind = "prompt" if stats.num_prompt_tokens_computed > prompt0 else "decode"
        steps[kind].append(elapsed)
        tokens[kind] += stats.num_prompt_tokens_computed - prompt0 + stats.num_generated_tokens - gen0
        for out in outputs:
            if out.finished:
                generated[out.request_id] = len(out.token_ids)
                add_next()
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    short = {r: (generated.get(r), n) for r, n in expected.items() if generated.get(r) != n}
    if short:
        raise RuntimeError(f"requests that did not generate their max_tokens: {short}")
    return {"requests": len(expected), "prompt_tokens": prompt_tokens, "generated_tokens": sum(generated.values()),
            "wall_s": wall, "cpu_s": cpu,
            "steps": {kind: {"count": len(v), "seconds": sum(v),
                             "median_ms": statistics.median(v) * 1e3 if v else None,
                             "p90_ms": sorted(v)[int(0.9 * len(v))] * 1e3 if v else None,
                             "tokens": tokens[kind]} for kind, v in steps.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="mixed", choices=[s for s in SHAPES if s != "jsonl"])
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--requests", type=int, default=120)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--model", help="HF model directory (default: the bundled model, prepared)")
    ap.add_argument("--out", help="write the figures to this JSON file")
    args = ap.parse_args(argv)
    llm = LLM(model=args.model or str(prepare_hf_model()), max_model_len=args.max_model_len,
              num_threads=args.threads, dtype=args.dtype)
    llm.generate(["warm up"], SamplingParams(max_tokens=4))  # kernels built and loaded before the clock
    spec = WorkloadSpec(shape=args.workload, seed=args.seed, max_model_len=args.max_model_len)
    result = replay(llm, spec, args.requests, args.concurrency)
    print(f"{args.workload} load, seed {args.seed}: {result['requests']} requests at concurrency {args.concurrency}, "
          f"{result['prompt_tokens']} prompt tokens, {result['generated_tokens']} generated; "
          f"{args.threads} threads, max_model_len {args.max_model_len}")
    print(f"wall {result['wall_s']:.1f} s, CPU {result['cpu_s']:.1f} s, "
          f"{result['generated_tokens'] / result['wall_s']:.1f} generated tok/s")
    for kind, s in result["steps"].items():
        if s["count"]:
            print(f"  {kind:6s} steps {s['count']:5d}  {s['seconds']:7.1f} s  median {s['median_ms']:7.1f} ms  "
                  f"p90 {s['p90_ms']:7.1f} ms  tokens {s['tokens']}")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), **result}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
