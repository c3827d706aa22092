"""Where vLLM's CPU build spends its time: py-spy `--native` on its processes while it generates offline.

    python benchmarks/profile_vllm.py [--process Worker|EngineCore] [--workload mixed] [--num-prompts 128]
                                      [--config defaults] [--seconds 30]

One offline generate in vLLM's venv (`benchmarks/vllm_offline_child.py`, as `peer_vllm.py` runs it, at
one of its configurations); once the timed generate has begun, py-spy samples one of vLLM's processes
(its model worker, VLLM::Worker, or its engine core, VLLM::EngineCore) for --seconds at 50 Hz, and the
samples are printed by category. One process a run: on 2 cores a second py-spy slows vLLM and
stretches its waits. py-spy sees Python threads only; of the worker, only its main thread's stacks (the
ones through `worker_busy_loop`, which runs the model) are counted, not its helper threads' waits.
Needs py-spy on PATH or beside this Python, and the right to ptrace (root).
"""

import argparse
import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `benchmarks.*`, run as a file
from benchmarks.peer_vllm import CHILD, CONFIG_NAMES, matched_len, venv_python, vllm_configs, vllm_env  # noqa: E402

GEMM = ("dnnl", "brgemm", "onednn", "mkl", "gemm")
# first match wins, tried on the whole stack
RULES = (("GEMMs (oneDNN)", GEMM),
         ("attention (cpu_attention, KV write)", ("cpu_attention", "attention", "kv_cache_update",
                                                  "reshape_and_cache")),
         ("sampling", ("Sampler", "sampler", "sample_tokens", "logits")),
         ("dtype copies", ("reduced_float_copy", "copy_")),
         ("scheduler and KV manager", ("scheduler.py", "kv_cache_manager", "block_pool", "kv_cache_coordinator")),
         ("IPC (shared-memory queue, ZeroMQ, pipes)", ("shm_broadcast", "zmq", "multiprocessing/connection",
                                                       "Socket.", "Poller")),
         ("inductor's fused kernels", ("Runner.call", "cpp_fused", "kernel_cpp")),
         ("sched_yield spin", ("sched_yield",)))


def category(stack: str) -> str:
    """The category of one py-spy raw stack (frames root first, ';'-separated)."""
    leaf = stack.rsplit(";", 1)[-1]
    if leaf.endswith("(?)"):  # code without symbols: oneDNN's JIT-generated GEMM kernels
        return RULES[0][0]
    if "libgomp" in leaf and not any(k in stack for k in GEMM):
        return "OpenMP barriers outside a GEMM"
    return next((name for name, keys in RULES if any(k in stack for k in keys)), "Python and the rest")


def shares(raw_lines, through: str = "") -> tuple[int, list[tuple[str, float]]]:
    """Samples and (category, share) from py-spy's raw output, largest first; only stacks holding `through`."""
    counts: collections.Counter[str] = collections.Counter()
    for line in raw_lines:
        stack, _, n = line.rstrip().rpartition(" ")
        if stack and through in stack:
            counts[category(stack)] += int(n)
    total = sum(counts.values())
    return total, [(name, c / total) for name, c in counts.most_common()] if total else []


def main() -> None:
    from transformers import AutoTokenizer

    from benchmarks.offline_workload import WORKLOADS, make_workload
    from benchmarks.prepare_model import prepare_hf_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="mixed", choices=WORKLOADS)
    ap.add_argument("--num-prompts", type=int, default=128, help="enough to outlast --seconds")
    ap.add_argument("--process", default="Worker", choices=("Worker", "EngineCore"))
    ap.add_argument("--config", default="defaults", choices=CONFIG_NAMES)
    ap.add_argument("--seconds", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        sys.exit("py-spy not found: pip install py-spy")

    workload = make_workload(args.num_prompts, kind=args.workload)
    model_dir = prepare_hf_model()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    match = matched_len([len(tokenizer(w.prompt)["input_ids"]) for w in workload], [w.max_tokens for w in workload])
    with tempfile.TemporaryDirectory(prefix="iterserve-vllm-profile-") as tmp_name:
        tmp = Path(tmp_name)
        (tmp / "spec.json").write_text(json.dumps({
            "model_dir": str(model_dir), "prompts": [w.prompt for w in workload],
            "max_tokens": [w.max_tokens for w in workload], "threads": args.threads,
            "engine_kwargs": vllm_configs(match)[args.config]}))
        result = tmp / "result.json"
        with open(tmp / "child.log", "w") as log:
            child = subprocess.Popen([str(venv_python()), str(CHILD), str(tmp / "spec.json"), str(result)],
                                     env=vllm_env(args.threads), stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        try:
            while not Path(str(result) + ".started").exists():
                if child.poll() is not None:
                    sys.exit(f"vLLM exited ({child.returncode}): see {tmp / 'child.log'}")
                time.sleep(1)
            time.sleep(3)  # past the generate's first prefill
            pid = subprocess.check_output(["pgrep", "-s", str(child.pid), "-f", f"VLLM::{args.process}"],
                                          text=True).split()[0]
            subprocess.run([spy, "record", "-p", pid, "--native", "-r", "50", "-d", str(args.seconds), "-f", "raw",
                            "-o", str(tmp / "raw.txt")], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
            child.wait(timeout=1800)
        finally:
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGKILL)
        run = json.loads(result.read_text())
        print(f"vLLM {run['version']} {args.config} ({run['dtype']}), {args.workload} x {args.num_prompts}: "
              f"{run['generated_tok_per_s']:.1f} gen tok/s; py-spy --native, 50 Hz, {args.seconds} s")
        total, rows = shares(open(tmp / "raw.txt"), "worker_busy_loop" if args.process == "Worker" else "")
        print(f"VLLM::{args.process} ({total} samples)")
        for label, share in rows:
            print(f"  {share * 100:5.1f}%  {label}")


if __name__ == "__main__":
    main()
