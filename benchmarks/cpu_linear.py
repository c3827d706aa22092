"""The default model's linear layers on this CPU: MKL sgemm (what `F.linear` runs) vs oneDNN with a
pre-packed weight (`torch.ops.mkldnn._linear_pointwise`), at the batch sizes a step sees.

    python benchmarks/cpu_linear.py [--runs 7] [--threads 2] [--batches 1,8,16,32,64,256]

Two views. Per layer: one projection's weight, called again and again, so it stays in cache. Per step:
every projection of all 30 layers, each with its own weight, then the LM head, as a decode step runs
them; 135 M fp32 parameters do not fit in any cache, so this is the view that decides. MKL and oneDNN
are timed alternately in one loop, so background load hits both alike; figures are medians.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

# SmolLM2-135M: hidden 576, 9 query + 3+3 KV heads of 64 (fused qkv), intermediate 1536, vocab 49152
SHAPES = {"qkv": (576, 960), "o_proj": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}
LM_HEAD = (576, 49152)
NUM_LAYERS = 30


def mkl(x, w, packed):
    return F.linear(x, w)


def onednn(x, w, packed):
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def pack(w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(w, 64)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def per_layer(m: int, runs: int) -> None:
    for name, (k, n) in {**SHAPES, "lm_head": LM_HEAD}.items():
        x, w = torch.randn(m, k), torch.randn(n, k)
        packed = pack(w)
        torch.testing.assert_close(onednn(x, w, packed), mkl(x, w, packed), atol=1e-3, rtol=1e-3)
        times = {f: [] for f in (mkl, onednn)}
        for _ in range(runs):
            for f in times:
                times[f].append(timed(lambda: f(x, w, packed)))
        a, b = (statistics.median(times[f]) * 1e3 for f in (mkl, onednn))
        print(f"{m:>4} {name:8} {a:9.3f} {b:9.3f} {a / b:8.2f}x", flush=True)


def per_step(m: int, runs: int, weights: dict) -> None:
    inputs = {name: torch.randn(m, k) for name, (k, _) in {**SHAPES, "lm_head": LM_HEAD}.items()}

    def step(f):
        for layer in weights["layers"]:
            for name, (w, packed) in layer.items():
                f(inputs[name], w, packed)
        f(inputs["lm_head"], *weights["lm_head"])

    times = {f: [] for f in (mkl, onednn)}
    for _ in range(runs):
        for f in times:
            times[f].append(timed(lambda: step(f)))
    a, b = (statistics.median(times[f]) * 1e3 for f in (mkl, onednn))
    print(f"{m:>4} {'step':8} {a:9.2f} {b:9.2f} {a / b:8.2f}x", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", default="1,8,16,32,64,256")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    print(f"torch {torch.__version__}, {args.threads} threads, CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}; medians of {args.runs} alternating runs, ms")
    print(f"{'M':>4} {'layer':8} {'MKL':>9} {'oneDNN':>9} {'MKL/oneDNN':>9}")
    for m in batches:
        per_layer(m, args.runs * 4)
    weights = {"layers": [{name: (w, pack(w)) for name, (k, n) in SHAPES.items() for w in [torch.randn(n, k)]}
                          for _ in range(NUM_LAYERS)]}
    lm_head = torch.randn(LM_HEAD[1], LM_HEAD[0])
    weights["lm_head"] = (lm_head, pack(lm_head))
    print(f"-- a whole step: {NUM_LAYERS} layers' projections, each its own weight, and the LM head")
    for m in batches:
        per_step(m, args.runs, weights)


if __name__ == "__main__":
    main()
