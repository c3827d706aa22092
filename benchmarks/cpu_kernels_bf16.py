"""The C++ CPU kernels in float32 vs bfloat16, microseconds per call, at SmolLM2-135M's shapes.

    python benchmarks/cpu_kernels_bf16.py [--runs 7] [--calls 200] [--threads 2]

Decode attention: a batch of 64 decodes, contexts around 300 tokens, 9 query heads over 3 KV heads of 64,
block size 16, blocks handed out in shuffled order (a bf16 cache halves the bytes each call streams).
Layer ops: 64 rows of hidden 576 (add + RMSNorm, rotary over the fused qkv's q and k heads) and
intermediate 1536 (SwiGLU). fp32 and bf16 calls alternate, run by run, so background load hits both
alike; figures are medians of the runs, each the mean of `calls` calls.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from iterserve.kernels import cpu_layer_ops, cpu_paged_attention

BATCH, HIDDEN, INTERMEDIATE = 64, 576, 1536
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
MAX_POSITIONS = 2048


def attention_case(dtype: torch.dtype, gen: torch.Generator):
    lens = torch.randint(260, 340, (BATCH,), generator=gen)
    per_req = (lens + BLOCK - 1) // BLOCK
    width = int(per_req.max())
    num_blocks = BATCH * width
    tables = torch.randperm(num_blocks, generator=gen).view(BATCH, width)
    shape = (num_blocks * BLOCK, KV_HEADS, HEAD_DIM)
    k_cache, v_cache = torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype)
    q = torch.randn(BATCH, HEADS, HEAD_DIM, generator=gen).to(dtype)
    module = cpu_paged_attention._extension.module
    return lambda: module.paged_decode_attention(q, k_cache, v_cache, tables, lens, BLOCK, HEAD_DIM**-0.5)


def layer_op_cases(dtype: torch.dtype, gen: torch.Generator) -> dict:
    module = cpu_layer_ops._extension.module
    x = torch.randn(BATCH, HIDDEN, generator=gen).to(dtype)
    residual = torch.randn(BATCH, HIDDEN, generator=gen).to(dtype)
    weight = torch.ones(HIDDEN, dtype=dtype)  # the model keeps norm weights in its dtype
    qkv = torch.randn(BATCH, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=gen).to(dtype)
    qk = qkv[:, : (HEADS + KV_HEADS) * HEAD_DIM].view(BATCH, HEADS + KV_HEADS, HEAD_DIM)
    cos, sin = torch.rand(MAX_POSITIONS, HEAD_DIM, generator=gen), torch.rand(MAX_POSITIONS, HEAD_DIM, generator=gen)
    positions = torch.randint(0, MAX_POSITIONS, (BATCH,), generator=gen)
    gate_up = torch.randn(BATCH, 2 * INTERMEDIATE, generator=gen).to(dtype)
    return {
        f"add_rms_norm {BATCH}x{HIDDEN}": lambda: module.add_rms_norm(x, residual, weight, 1e-5),
        f"rotary {BATCH}x{HEADS + KV_HEADS}x{HEAD_DIM}": lambda: module.rotary(qk, positions, cos, sin),
        f"silu_and_mul {BATCH}x{INTERMEDIATE}": lambda: module.silu_and_mul(gate_up),
    }


def mean_us(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not (cpu_paged_attention.available() and cpu_layer_ops.available()):
        raise SystemExit("the C++ kernels did not build or load (see the warning above)")
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    cases: dict[str, dict[str, object]] = {}
    for name, dtype in dtypes.items():
        gen = torch.Generator().manual_seed(0)
        ops = {f"decode attention b{BATCH} ctx~300": attention_case(dtype, gen), **layer_op_cases(dtype, gen)}
        for op, fn in ops.items():
            cases.setdefault(op, {})[name] = fn
    times: dict[tuple[str, str], list[float]] = {}
    for op, fns in cases.items():
        for fn in fns.values():
            mean_us(fn, 10)  # warm-up: first-touch pages, OpenMP pool
        for _ in range(args.runs):
            for name, fn in fns.items():  # fp32, bf16, fp32, bf16, ...
                times.setdefault((op, name), []).append(mean_us(fn, args.calls))
    print(f"torch {torch.__version__}, {args.threads} threads, median of {args.runs} runs x {args.calls} calls")
    print(f"{'op':36} {'fp32 us':>9} {'bf16 us':>9} {'fp32/bf16':>10}")
    for op in cases:
        fp32, bf16 = (statistics.median(times[(op, name)]) for name in dtypes)
        print(f"{op:36} {fp32:9.1f} {bf16:9.1f} {fp32 / bf16:9.2f}x")


if __name__ == "__main__":
    main()
