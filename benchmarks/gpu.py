"""The GPU benchmark of the Triton path: every figure of the GPU issue in one run (one call on an H200).

    bash benchmarks/gpu_run.sh OUT_DIR              # on the GPU machine: installs from this tree, runs this
    python benchmarks/gpu.py --out DIR [--smoke] [--only SECTION,...] [--budget-s 540]

Sections, in order (each one's failure is recorded and the run goes on; results are rewritten to
DIR/gpu.json after every section and printed as a table at the end):
  env          versions, device, SMs
  kernel_check every Triton kernel on the device, in bf16, against its fp32 torch reference
  copy         device-to-device copy bandwidth: the ceiling for memory-bound kernels
  decode       paged decode kernel at several batch x context shapes: GB/s, share of the copy
               bandwidth (target >= 0.8 at long contexts), speed vs SDPA on contiguous tensors (>= 0.9)
  prefill      varlen prefill kernel: TFLOP/s, and vs SDPA (causal) for fresh prefills
  batch1       end-to-end batch-1 decode tok/s of a Llama-3-8B-shaped model (random bf16 weights, no
               download), with and without CUDA graphs, against the roofline copy_bw / bytes per step
               (target >= 0.7)
  throughput   offline throughput, N requests (default 512) with input/output lengths ~1000/1000,
               ignore_eos, continuous policy (target >= 10,000 output tok/s on an H200)
  static       the same workload under the static policy: the continuous/static ratio on a GPU
--smoke runs every section at toy sizes on CPU through the Triton interpreter, to test this script.
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:  # before anything imports triton: the kernels run interpreted on CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ["ITERSERVE_SMOKE"] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

if __package__ in (None, ""):  # run as a file: make `benchmarks.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, intermediate_size=14336,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
    rope_theta=500000.0, max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=False,
    bos_token_id=128000, eos_token_id=128001,
)
TINY = dict(LLAMA3_8B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=320, max_position_embeddings=512)


@dataclass
class Sizes:
    model: dict
    device: str
    dtype: str
    copy_bytes: int
    decode_shapes: list[tuple[int, int]]
    prefill_shapes: list[tuple[int, int, int]]
    timing_iters: int
    batch1_prompt: int
    batch1_tokens: int
    num_requests: int
    input_len: tuple[int, int]
    output_len: tuple[int, int]
    engine: dict = field(default_factory=dict)


FULL = Sizes(
    model=LLAMA3_8B, device="cuda", dtype="bfloat16", copy_bytes=4 * 2**30,
    decode_shapes=[(1, 1024), (1, 8192), (1, 32768), (8, 8192), (32, 4096), (64, 2048), (128, 2048), (256, 1024)],
    prefill_shapes=[(1, 0, 4096), (8, 0, 512), (4, 1536, 512)],
    timing_iters=20, batch1_prompt=128, batch1_tokens=256,
    num_requests=512, input_len=(750, 1250), output_len=(750, 1250),
    engine=dict(max_model_len=4096, max_num_seqs=512, max_num_batched_tokens=8192, prefill_chunk_size=2048),
)
SMOKE = Sizes(
    model=TINY, device="cpu", dtype="float32", copy_bytes=2**20,
    decode_shapes=[(2, 40)], prefill_shapes=[(1, 0, 20), (2, 9, 7)],
    timing_iters=2, batch1_prompt=4, batch1_tokens=4,
    num_requests=4, input_len=(8, 20), output_len=(3, 6),
    engine=dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, prefill_chunk_size=16,
                kv_cache_memory="1MiB", attention_backend="triton"),
)


def write_model_dir(out: Path, model: dict) -> Path:
    """A model directory holding only config.json: enough for load_format="dummy"."""
    path = out / f"dummy-{model['num_hidden_layers']}L-{model['hidden_size']}"
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(model, indent=1))
    return path


def build_engine(sizes: Sizes, out: Path):
    from iterserve.server.config import EngineConfig
    from iterserve.server.engine.engine_factory import build_engine as build

    options = dict(sizes.engine)
    engine = build(EngineConfig(model=str(write_model_dir(out, sizes.model)), load_format="dummy",
                                device=sizes.device, dtype=sizes.dtype, **options))
    runner = engine.model_runner
    if sizes.device == "cpu":  # smoke: the static-buffer decode path that CUDA graphs capture, uncaptured
        runner.enable_static_decode(max_batch=options["max_num_seqs"], capture=False)
    return engine


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def bytes_per_decode_step(runner) -> int:
    """Weights read by one decode step: every parameter but the embedding table (one row of it is read)."""
    model = runner.model
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.lm_head is not None:
        total -= model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    return total


def batch1_decode(engine, sizes: Sizes, copy_gb_s: float | None) -> dict:
    from iterserve.server.engine.sampling_params import SamplingParams

    runner = engine.model_runner
    rng = random.Random(1)
    prompt = [rng.randrange(engine.vocab_size) for _ in range(sizes.batch1_prompt)]

    def one_run() -> tuple[float, list[int]]:
        engine.add_request(prompt_token_ids=prompt, sampling_params=SamplingParams(
            max_tokens=sizes.batch1_tokens, temperature=0, ignore_eos=True))
        tokens, start = [], None
        while engine.has_unfinished_requests():
            for o in engine.step():
                tokens += o.new_token_ids
            if start is None and tokens:  # timing starts after the prefill step's first token
                sync(sizes.device)
                start, first = time.perf_counter(), len(tokens)
        sync(sizes.device)
        return (len(tokens) - first) / (time.perf_counter() - start), tokens

    result = {}
    saved = runner.static_decode
    modes = [("eager", None)]
    if saved is not None:  # smoke runs the static buffers uncaptured on CPU: say so in the name
        modes.insert(0, ("cuda_graphs" if saved.capture else "static_buffers", saved))
    outputs = {}
    for name, static in modes:
        runner.static_decode = static
        one_run()  # warm-up: compiles kernels, captures the batch-1 graph
        if static is not None and runner.static_decode is None:
            result[f"{name}_failed"] = "the runner fell back to eager (see the log)"
            saved = None
            continue
        result[f"{name}_tok_per_s"], outputs[name] = one_run()
    runner.static_decode = saved
    if len(outputs) == 2:  # split-KV sizes differ between the two, so bits (and a few argmaxes) may too
        a, b = outputs.values()
        result["static_vs_eager_token_match"] = sum(x == y for x, y in zip(a, b, strict=True)) / len(a)
    step_bytes = bytes_per_decode_step(runner)
    result["weight_bytes_per_step"] = step_bytes
    if copy_gb_s:
        result["roofline_tok_per_s"] = copy_gb_s * 1e9 / step_bytes
        best = max(v for k, v in result.items() if k.endswith("_tok_per_s") and not k.startswith("roofline"))
        result["fraction_of_roofline"] = best / result["roofline_tok_per_s"]
    return result


def add_requests(engine, sizes: Sizes) -> tuple[list[str], int]:
    """The throughput workload: num_requests random-token requests (seed 0), ignore_eos, greedy. Returns
    their ids and the prompt tokens added."""
    from iterserve.server.engine.sampling_params import SamplingParams

    rng = random.Random(0)
    ids, prompt_tokens = [], 0
    for _ in range(sizes.num_requests):
        n = rng.randint(*sizes.input_len)
        prompt_tokens += n
        ids.append(engine.add_request(
            prompt_token_ids=[rng.randrange(engine.vocab_size) for _ in range(n)],
            sampling_params=SamplingParams(max_tokens=rng.randint(*sizes.output_len), temperature=0,
                                           ignore_eos=True)))
    return ids, prompt_tokens


def throughput(engine, sizes: Sizes, deadline: float) -> dict:
    """Offline throughput of num_requests random-token requests, ignore_eos; cut short at the deadline."""
    ids, prompt_tokens = add_requests(engine, sizes)
    stats = engine.stats
    generated0, steps0 = stats.num_generated_tokens, stats.num_steps
    start = time.perf_counter()
    truncated = False
    while engine.has_unfinished_requests():
        engine.step()
        if time.perf_counter() > deadline:
            truncated = True
            for i in ids:
                engine.abort_request(i)
            break
    sync(sizes.device)
    seconds = time.perf_counter() - start
    generated = stats.num_generated_tokens - generated0
    return {"policy": engine.scheduler.policy, "num_requests": sizes.num_requests, "prompt_tokens": prompt_tokens,
            "generated_tokens": generated, "seconds": seconds, "output_tok_per_s": generated / seconds,
            "steps": stats.num_steps - steps0, "preemptions": stats.num_preemptions, "truncated": truncated}


def static_engine(engine):
    """A static-policy engine over the same model runner and KV memory (the first engine is idle)."""
    from iterserve.server.engine.llm_engine import LLMEngine

    bm = engine.block_manager
    return LLMEngine(engine.model_runner, tokenizer=None, max_model_len=engine.max_model_len,
                     num_blocks=bm.num_blocks, block_size=bm.block_size, knobs=engine.knobs.value,
                     policy="static", eos_token_ids=engine.core.eos_token_ids, vocab_size=engine.vocab_size)


def environment(sizes: Sizes) -> dict:
    import importlib.util

    env = {"python": platform.python_version(), "torch": torch.__version__, "smoke": sizes is SMOKE,
           "triton_interpret": os.environ.get("TRITON_INTERPRET", "0")}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError as exc:
        env["triton"] = f"missing: {exc}"
    import shutil

    # Triton builds its launcher with the system C compiler on first use: without one, no kernel runs
    env["c_compiler"] = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or "missing"
    env["missing_optional_modules"] = [m for m in ("numpy", "safetensors", "tokenizers", "gguf", "jinja2")
                                       if importlib.util.find_spec(m) is None]
    if sizes.device == "cuda":
        p = torch.cuda.get_device_properties(0)
        env.update(device=p.name, sms=p.multi_processor_count, memory_gib=p.total_memory / 2**30,
                   cuda=torch.version.cuda)
    else:
        env.update(device=platform.processor() or "cpu", threads=torch.get_num_threads())
    return env


def print_table(results: dict) -> None:
    for name, value in results.items():
        if isinstance(value, dict) and "error" in value:
            print(f"{name:<14} FAILED: {value['error'].strip().splitlines()[-1]}")
        elif isinstance(value, list):
            print(f"{name}:")
            for row in value:
                print("   " + "  ".join(f"{k}={_fmt(v)}" for k, v in row.items()))
        elif isinstance(value, dict):
            print(f"{name:<14} " + "  ".join(f"{k}={_fmt(v)}" for k, v in value.items()))


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


SECTIONS = ("env", "kernel_check", "copy", "decode", "prefill", "batch1", "throughput", "static")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory for gpu.json (and the dummy model's config.json)")
    ap.add_argument("--smoke", action="store_true", help="toy sizes on CPU through the Triton interpreter")
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    ap.add_argument("--budget-s", type=float, default=540.0, help="the whole run's time limit")
    ap.add_argument("--num-requests", type=int, default=None, help="throughput requests (default 512)")
    args = ap.parse_args()

    from benchmarks import gpu_kernels as kb

    sizes = SMOKE if args.smoke else FULL
    if args.num_requests:
        sizes.num_requests = args.num_requests
    if sizes.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --smoke to test this script on CPU", file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    deadline = t_start + args.budget_s
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    wanted = set(args.only.split(","))
    device, dtype = torch.device(sizes.device), getattr(torch, sizes.dtype)
    shape = dict(heads=sizes.model["num_attention_heads"], kv_heads=sizes.model["num_key_value_heads"],
                 head_dim=sizes.model["head_dim"], hidden=sizes.model["hidden_size"])
    results: dict = {}
    state: dict = {}

    def timer():
        return kb.Timer(device, sizes.timing_iters)

    def copy_gb_s():
        return results.get("copy", {}).get("gb_per_s")

    def engine():
        if "engine" not in state:
            state["engine"] = build_engine(sizes, out)
        return state["engine"]

    def continuous():
        remaining = deadline - time.perf_counter()
        return throughput(engine(), sizes, time.perf_counter() + remaining * (0.55 if "static" in wanted else 0.95))

    sections = {
        "env": lambda: environment(sizes),
        "kernel_check": lambda: kb.check_kernels(shape, dtype, device),
        "copy": lambda: kb.copy_bandwidth(sizes.copy_bytes, device, timer()),
        "decode": lambda: kb.decode_kernel(sizes.decode_shapes, shape, dtype, device, timer(), copy_gb_s() or 1.0),
        "prefill": lambda: kb.prefill_kernel(sizes.prefill_shapes, shape, dtype, device, timer()),
        "batch1": lambda: batch1_decode(engine(), sizes, copy_gb_s()),
        "throughput": continuous,
        "static": lambda: throughput(static_engine(engine()), sizes, deadline),
    }
    for name in SECTIONS:
        if name not in wanted:
            continue
        t0 = time.perf_counter()
        if t0 > deadline:
            results[name] = {"error": "skipped: the time budget ran out"}
            continue
        print(f"[{t0 - t_start:6.1f}s] {name} ...", flush=True)
        try:
            results[name] = sections[name]()
        except Exception:  # record it and go on: one failing section must not cost the others
            results[name] = {"error": traceback.format_exc()}
            print(results[name]["error"], file=sys.stderr, flush=True)
        if isinstance(results[name], dict):
            results[name]["section_seconds"] = time.perf_counter() - t0
        if sizes.device == "cuda" and "engine" not in state:
            torch.cuda.empty_cache()  # leave the engine's KV pool all the memory
        if "throughput" in results and "static" in results and "error" not in results["static"]:
            cont, stat = results["throughput"], results["static"]
            if "output_tok_per_s" in cont:
                results["continuous_over_static"] = cont["output_tok_per_s"] / stat["output_tok_per_s"]
        results["total_seconds"] = time.perf_counter() - t_start
        (out / "gpu.json").write_text(json.dumps(results, indent=1, default=str))
    print_table(results)
    print(f"results: {out / 'gpu.json'}  ({results['total_seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
