"""What structured output costs a batch: throughput at batch 64 with half the requests under a JSON schema,
against the same batch with none, interleaved A B A B, medians.

    python benchmarks/structured_output.py [--threads 2] [--rounds 3] [--max-tokens 128]

SmolLM2-135M-Instruct fp32 (prepare_model.py), 64 prompts of benchmarks/offline_workload.py, greedy, every
request max_tokens long (`ignore_eos` for the plain ones). Either schema (`--schema`) asks for 12 items, more
than max_tokens holds, so the grammar requests run their full length too and both batches generate the
same number of tokens: `records` (open strings, enums, bounded integers) or `notes` (strings of 20-40
characters, the case where xgrammar's mask costs most). The grammar is compiled once before the timed runs
(the cache then serves it); its compile time is printed on its own. Printed: generated tok/s of each run,
the medians and the loss.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `benchmarks.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.offline_workload import PROMPTS
from benchmarks.prepare_model import prepare_hf_model
from iterserve.server.config import EngineConfig
from iterserve.server.engine.sampling_params import SamplingParams
from iterserve.server.engine.structured_output import StructuredOutput
from iterserve.server.entrypoints.llm import LLM

SCHEMAS = {
    # length-bounded strings: xgrammar's costly case (benchmarks/grammar_engines.py)
    "notes": {"type": "object",
              "properties": {"notes": {"type": "array", "minItems": 12, "maxItems": 12,
                                       "items": {"type": "string", "minLength": 20, "maxLength": 40}}},
              "required": ["notes"], "additionalProperties": False},
    # open strings, enums and bounded integers, as tool calls and extraction schemas mostly are
    "records": {"type": "object",
                "properties": {"records": {"type": "array", "minItems": 12, "maxItems": 12, "items": {
                    "type": "object",
                    "properties": {"title": {"type": "string"}, "kind": {"enum": ["book", "film", "song"]},
                                   "year": {"type": "integer", "minimum": 1900, "maximum": 2030}},
                    "required": ["title", "kind", "year"], "additionalProperties": False}}},
                "required": ["records"], "additionalProperties": False},
}


def params(n: int, max_tokens: int, with_grammar: bool, schema: dict) -> list[SamplingParams]:
    spec = StructuredOutput(json_schema=json.dumps(schema))
    return [SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                           structured_output=spec if with_grammar and i % 2 == 0 else None) for i in range(n)]


def timed_run(llm: LLM, prompts: list[str], sps: list[SamplingParams]) -> tuple[float, int, int]:
    start = time.perf_counter()
    outs = llm.generate(prompts, sps)
    seconds = time.perf_counter() - start
    generated = sum(len(o.token_ids) for o in outs)
    valid = 0
    for o, sp in zip(outs, sps, strict=True):
        if sp.structured_output is not None and o.finish_reason == "stop":
            json.loads(o.text)
            valid += 1
    return generated / seconds, generated, valid


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--schema", choices=sorted(SCHEMAS), default="records")
    args = ap.parse_args()
    schema = SCHEMAS[args.schema]
    torch.set_num_threads(args.threads)
    model_dir = prepare_hf_model()
    llm = LLM(config=EngineConfig(model=str(model_dir), dtype="float32", max_num_seqs=args.batch,
                                  num_threads=args.threads, kv_cache_memory="2GiB"))
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.batch)]
    t0 = time.perf_counter()
    # warm-up at the full batch (first-call costs of batch-64 shapes stay out of the timing); compiles (and
    # caches) the grammar
    llm.generate(prompts, params(args.batch, 4, True, schema))
    warm = time.perf_counter() - t0
    runs: dict[str, list[float]] = {"none": [], "half": []}
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, {args.threads} threads, "
          f"batch {args.batch}, max_tokens {args.max_tokens}, schema {args.schema}, {time.strftime('%Y-%m-%d')}; "
          f"warm-up with the first compile {warm:.2f} s")
    for r in range(args.rounds):
        for kind in ("none", "half"):  # A B A B
            tps, generated, valid = timed_run(llm, prompts, params(args.batch, args.max_tokens, kind == "half", schema))
            runs[kind].append(tps)
            print(f"round {r + 1} {kind:>4}: {tps:7.1f} generated tok/s ({generated} tokens"
                  f"{f', {valid} grammar requests closed their JSON' if kind == 'half' else ''})")
    none, half = statistics.median(runs["none"]), statistics.median(runs["half"])
    print(f"median: no grammar {none:.1f} tok/s, half under a JSON schema {half:.1f} tok/s, "
          f"ratio {half / none:.3f} (loss {100 * (1 - half / none):.1f}%; target <= 10%)")


if __name__ == "__main__":
    main()
