"""The default model's linear layers on this CPU: MKL sgemm (what `F.linear` runs) vs oneDNN with a
pre-packed weight (`torch.ops.mkldnn._linear_pointwise`), at the batch sizes a decode step sees.

The two are timed alternately in one loop, so background load hits both alike; the min over the runs
is the figure (a stall only ever adds time). Usage: `python benchmarks/cpu_linear.py [--runs 30] [--threads 2]`.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

# SmolLM2-135M: hidden 576, 9 query + 3+3 KV heads of 64 (fused qkv), intermediate 1536, vocab 49152
SHAPES = {"qkv": (576, 960), "o_proj": (576, 576), "gate_up": (576, 3072), "down": (1536, 576),
          "lm_head": (576, 49152)}


def _time(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", default="1,8,32,64")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, min of {args.runs} alternating runs (ms)")
    print(f"{'M':>3} {'layer':8} {'MKL':>8} {'oneDNN':>8} {'MKL/oneDNN':>10}")
    for m in (int(b) for b in args.batches.split(",")):
        for name, (k, n) in SHAPES.items():
            x, w = torch.randn(m, k), torch.randn(n, k)
            packed = torch.ops.mkldnn._reorder_linear_weight(w, 64)
            fns = {"mkl": lambda: torch.nn.functional.linear(x, w),
                   "onednn": lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")}
            torch.testing.assert_close(fns["onednn"](), fns["mkl"](), atol=1e-3, rtol=1e-3)
            times = {key: [] for key in fns}
            for _ in range(3):
                for f in fns.values():
                    f()
            for _ in range(args.runs):
                for key, f in fns.items():
                    times[key].append(_time(f))
            mkl, onednn = (min(times[key]) * 1e3 for key in ("mkl", "onednn"))
            print(f"{m:>3} {name:8} {mkl:8.3f} {onednn:8.3f} {mkl / onednn:9.2f}x"
                  f"   (medians {statistics.median(times['mkl']) * 1e3:.3f} / "
                  f"{statistics.median(times['onednn']) * 1e3:.3f})", flush=True)


if __name__ == "__main__":
    main()
