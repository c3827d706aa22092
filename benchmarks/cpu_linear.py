"""The default model's linear layers on this CPU, each way the engine could run them, at the batch sizes a
step sees: in fp32 MKL sgemm (what `F.linear` runs) against oneDNN with a pre-packed weight
(`torch.ops.mkldnn._linear_pointwise`, what PackedLinear runs); in bf16 `F.linear`, oneDNN packed, and the
C++ AVX512-BF16 kernel (kernels/cpu_bf16_linear.py, what PackedLinear runs where it serves).

    python benchmarks/cpu_linear.py [--dtype float32|bfloat16] [--runs 7] [--threads 2] [--batches 1,8,16,32,64,256]

Two views. Per layer: one projection's weight, called again and again, so it stays in cache. Per step:
every projection of all 30 layers, each with its own weight, then the LM head, as a decode step runs
them; 135 M parameters do not fit in any cache, so this is the view that decides. The ways are timed
alternately in one loop, so background load hits them alike; figures are medians, and the last column
divides the first way's time by each other's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from iterserve.kernels import cpu_bf16_linear

# SmolLM2-135M: hidden 576, 9 query + 3+3 KV heads of 64 (fused qkv), intermediate 1536, vocab 49152
SHAPES = {"qkv": (576, 960), "o_proj": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}
LM_HEAD = (576, 49152)
NUM_LAYERS = 30


class Prepared:
    """A weight prepared once for one way of running it, with its output width (the kernel's call needs it)."""

    def __init__(self, prepare, w: torch.Tensor):
        self.value, self.out_features = prepare(w), w.shape[0]


def ways(dtype: torch.dtype) -> dict:
    """name -> (prepare a weight once, run x against a Prepared)"""
    onednn = (lambda w: torch.ops.mkldnn._reorder_linear_weight(w, 64),
              lambda x, p: torch.ops.mkldnn._linear_pointwise(x, p.value, None, "none", [], ""))
    plain = (lambda w: w, lambda x, p: F.linear(x, p.value))
    if dtype == torch.float32:
        return {"MKL": plain, "oneDNN": onednn}
    found = {"F.linear": plain, "oneDNN": onednn}
    if cpu_bf16_linear.available():
        found["kernel"] = (cpu_bf16_linear.pack, lambda x, p: cpu_bf16_linear.linear(x, p.value, p.out_features, None))
    return found


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def row(m: int, label: str, times: dict, digits: int) -> None:
    ms = [statistics.median(t) * 1e3 for t in times.values()]
    ratios = " ".join(f"{ms[0] / x:7.2f}x" for x in ms[1:])
    print(f"{m:>4} {label:8} " + " ".join(f"{x:9.{digits}f}" for x in ms) + f"  {ratios}", flush=True)


def per_layer(m: int, runs: int, dtype: torch.dtype) -> None:
    for name, (k, n) in {**SHAPES, "lm_head": LM_HEAD}.items():
        x, w = torch.randn(m, k).to(dtype), torch.randn(n, k).to(dtype)
        prepared = {label: Prepared(way[0], w) for label, way in ways(dtype).items()}
        reference = F.linear(x.float(), w.float())
        for label, way in ways(dtype).items():
            torch.testing.assert_close(way[1](x, prepared[label]).float(), reference, atol=0.1, rtol=2e-2)
        times: dict = {label: [] for label in prepared}
        for _ in range(runs):
            for label, way in ways(dtype).items():
                times[label].append(timed(lambda: way[1](x, prepared[label])))
        row(m, name, times, 3)


def per_step(m: int, runs: int, dtype: torch.dtype, weights: list) -> None:
    inputs = {name: torch.randn(m, k).to(dtype) for name, (k, _) in {**SHAPES, "lm_head": LM_HEAD}.items()}

    def step(label, way):
        for layer in weights:
            for name, prepared in layer.items():
                way[1](inputs[name], prepared[label])

    times: dict = {label: [] for label in ways(dtype)}
    for _ in range(runs):
        for label, way in ways(dtype).items():
            times[label].append(timed(lambda: step(label, way)))
    row(m, "step", times, 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", default="1,8,16,32,64,256")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    labels = list(ways(dtype))
    print(f"torch {torch.__version__}, {args.threads} threads, {args.dtype}, CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}; medians of {args.runs} alternating runs, ms")
    print(f"{'M':>4} {'layer':8} " + " ".join(f"{label:>9}" for label in labels)
          + "  " + " ".join(f"{labels[0]}/{label}" for label in labels[1:]))
    for m in batches:
        per_layer(m, args.runs * 4, dtype)
    weights = []
    for _ in range(NUM_LAYERS):
        layer = {}
        for name, (k, n) in SHAPES.items():
            w = torch.randn(n, k).to(dtype)
            layer[name] = {label: Prepared(way[0], w) for label, way in ways(dtype).items()}
        weights.append(layer)
    lm_head = torch.randn(LM_HEAD[1], LM_HEAD[0]).to(dtype)
    weights.append({"lm_head": {label: Prepared(way[0], lm_head) for label, way in ways(dtype).items()}})
    print(f"-- a whole step: {NUM_LAYERS} layers' projections, each its own weight, and the LM head")
    for m in batches:
        per_step(m, args.runs, dtype, weights)


if __name__ == "__main__":
    main()
