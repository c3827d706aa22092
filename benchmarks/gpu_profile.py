"""Where an engine step's time goes on the GPU, in the throughput section's workload (one call on an H200).

    python benchmarks/gpu_profile.py --out DIR [--smoke] [--steps 400] [--profile-steps 8]

Builds the engine of benchmarks/gpu.py (Llama-3-8B-shaped, random bf16 weights), adds its 512 requests
and runs `--steps` steps, timing each one's three parts with the device synchronized around them:
scheduling, the model runner (input preparation, forward pass, sampling: its token ids reach the host, so
the GPU's work is inside it) and the engine's update of its requests. Then `--profile-steps` decode steps
run under torch.profiler: the GPU's busy share of their wall time, and the ops that take the most device
and host time. Prints the table; writes DIR/gpu_profile.json and DIR/gpu_profile_trace.json.gz (Chrome
trace). `--smoke` runs it at toy sizes on CPU through the Triton interpreter, to test this script.
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:  # before anything imports triton
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ["ITERSERVE_SMOKE"] = "1"

import argparse  # noqa: E402
import gzip  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


from benchmarks.gpu import FULL, SMOKE, add_requests, build_engine, sync  # noqa: E402


class StepTimer:
    """Wraps the core's scheduler and runner (instance attributes over the bound methods) to time each part."""

    def __init__(self, engine, device: str) -> None:
        core = engine.core
        self.device, self.rows, self.current = device, [], {}
        schedule, execute = core.scheduler.schedule, core.model_runner.execute_model

        def timed_schedule():
            t = time.perf_counter()
            out = schedule()
            self.current = {"schedule_ms": (time.perf_counter() - t) * 1e3, "seqs": len(out.scheduled),
                            "tokens": out.total_num_scheduled_tokens,
                            "decode_only": all(len(s.new_token_ids) == 1 for s in out.scheduled)}
            return out

        def timed_execute(out):
            t = time.perf_counter()
            result = execute(out)
            sync(self.device)
            self.current["runner_ms"] = (time.perf_counter() - t) * 1e3
            return result

        core.scheduler.schedule, core.model_runner.execute_model = timed_schedule, timed_execute

    def step(self, engine) -> None:
        sync(self.device)
        t = time.perf_counter()
        engine.step()
        sync(self.device)
        row = self.current
        row["step_ms"] = (time.perf_counter() - t) * 1e3
        row["update_ms"] = row["step_ms"] - row.get("schedule_ms", 0.0) - row.get("runner_ms", 0.0)
        self.rows.append(row)


def summarize(rows: list[dict]) -> dict:
    out = {}
    for kind, pick in (("decode_only", lambda r: r["decode_only"]), ("with_prefill", lambda r: not r["decode_only"])):
        chosen = [r for r in rows if pick(r) and "runner_ms" in r]
        if not chosen:
            continue
        out[kind] = {"steps": len(chosen), "seqs_median": statistics.median(r["seqs"] for r in chosen),
                     "tokens_median": statistics.median(r["tokens"] for r in chosen)}
        for part in ("step_ms", "schedule_ms", "runner_ms", "update_ms"):
            out[kind][part] = statistics.median(r[part] for r in chosen)
        out[kind]["share_of_wall"] = sum(r["step_ms"] for r in chosen) / sum(r["step_ms"] for r in rows)
    return out


def profile(engine, timer: StepTimer, steps: int, out: Path, device: str) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    sync(device)
    t = time.perf_counter()
    with torch_profile(activities=activities) as prof:
        for _ in range(steps):
            if not engine.has_unfinished_requests():
                break
            timer.step(engine)
    wall_us = (time.perf_counter() - t) * 1e6
    from torch.autograd import DeviceType

    events = prof.key_averages()
    cuda_attr = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
    # the device's own events (kernels, copies, memsets): a host op that launched a kernel reports its time too,
    # and summing both would count it twice
    on_device = [e for e in events if e.device_type == DeviceType.CUDA]
    by_device = sorted(on_device, key=lambda e: getattr(e, cuda_attr, 0), reverse=True)[:20]
    by_host = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:20]
    device_us = sum(getattr(e, cuda_attr, 0) for e in on_device)
    trace = out / "gpu_profile_trace.json"
    prof.export_chrome_trace(str(trace))
    with open(trace, "rb") as src, gzip.open(str(trace) + ".gz", "wb") as dst:
        dst.write(src.read())
    trace.unlink()
    return {"steps": steps, "wall_ms_per_step": wall_us / 1e3 / steps,
            "device_busy_ms_per_step": device_us / 1e3 / steps, "device_busy_share": device_us / wall_us,
            "top_device_ops": [{"op": e.key, "ms_per_step": getattr(e, cuda_attr, 0) / 1e3 / steps,
                                "calls_per_step": e.count / steps} for e in by_device],
            "top_host_ops": [{"op": e.key, "ms_per_step": e.self_cpu_time_total / 1e3 / steps,
                              "calls_per_step": e.count / steps} for e in by_host]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--steps", type=int, default=400, help="steps timed part by part (then the profiled ones)")
    ap.add_argument("--profile-steps", type=int, default=8, help="decode steps under torch.profiler")
    ap.add_argument("--num-requests", type=int, default=None)
    args = ap.parse_args()
    sizes = SMOKE if args.smoke else FULL
    if args.num_requests:
        sizes.num_requests = args.num_requests
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    engine = build_engine(sizes, out)
    runner = engine.model_runner
    result: dict = {"build_s": time.perf_counter() - t0, "graphs": runner.static_decode is not None,
                    "graph_max_batch": getattr(runner.static_decode, "sizes", [None])[-1]
                    if runner.static_decode is not None else None,
                    "num_blocks": engine.block_manager.num_blocks, "block_size": engine.block_manager.block_size}
    add_requests(engine, sizes)
    timer = StepTimer(engine, sizes.device)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        if not engine.has_unfinished_requests():
            break
        timer.step(engine)
    result["timed_seconds"] = time.perf_counter() - t0
    result["generated_tokens"] = engine.stats.num_generated_tokens
    result.update(summarize(timer.rows))
    result["first_steps"] = timer.rows[:5]
    if engine.has_unfinished_requests():
        result["profile"] = profile(engine, timer, args.profile_steps, out, sizes.device)
    (out / "gpu_profile.json").write_text(json.dumps(result, indent=1, default=str))
    for key, value in result.items():
        if isinstance(value, dict) and key != "profile":
            print(f"{key:<13} " + "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                            for k, v in value.items()))
        elif key not in ("profile", "first_steps"):
            print(f"{key:<13} {value}")
    if "profile" in result:
        p = result["profile"]
        print(f"profile       wall {p['wall_ms_per_step']:.2f} ms/step, device busy {p['device_busy_ms_per_step']:.2f}"
              f" ms/step ({p['device_busy_share']:.0%})")
        for title, rows in (("device", p["top_device_ops"]), ("host", p["top_host_ops"])):
            print(f"top {title} ops (ms per step, calls per step):")
            for r in rows[:15]:
                print(f"  {r['ms_per_step']:8.3f}  {r['calls_per_step']:7.1f}  {r['op'][:90]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
