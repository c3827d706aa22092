"""Compile every Triton kernel of iterserve for Hopper (sm_90) without a GPU, as a script:

    python tests/triton_compile_check.py [bf16 fp16 fp32]

The interpreter the CPU tests use does not type-check what the GPU compiler does (dot shapes and
dtypes, constexpr use, mixed integer widths in loops); this runs the real compiler down to PTX and
ptxas (bundled with the triton wheel), at the shapes the engine uses for Llama-3-8B. It must run in a
process without TRITON_INTERPRET. Prints one line per kernel; exits 1 if any fails.
"""

from __future__ import annotations

import os
import sys
import time

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    sys.exit("triton_compile_check: unset TRITON_INTERPRET (it makes kernels interpreted, not compiled)")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from iterserve.kernels import triton_decode_attention as decode  # noqa: E402
from iterserve.kernels import triton_kv_write as kv_write  # noqa: E402
from iterserve.kernels import triton_layer_ops as layer_ops  # noqa: E402
from iterserve.kernels import triton_prefill_attention as prefill  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
_INT_POINTERS = {"token_index_ptr", "block_tables_ptr", "context_lens_ptr", "query_start_ptr", "query_lens_ptr",
                 "slot_ptr", "positions_ptr"}
_FP32_POINTERS = {"part_out_ptr", "part_lse_ptr", "cos_ptr", "sin_ptr"}


def arg_type(name: str, dtype: str) -> str:
    if name in _INT_POINTERS:
        return "*i32"
    if name in _FP32_POINTERS:
        return "*fp32"
    if name.endswith("_ptr"):
        return f"*{dtype}"
    return "fp32" if name in ("qk_scale", "eps") else "i32"


def kernels(dtype: str):
    """(name, lazy kernel, constexprs, num_warps) at Llama-3-8B's shapes (32/8 heads of 128, hidden 4096)."""
    precision = "ieee" if dtype == "fp32" else "tf32"
    attention = dict(GROUP=4, HEAD_DIM=128, BLOCK_D=128, BLOCK_SIZE=16, DOT_PRECISION=precision)
    return [
        ("decode", decode._decode_kernel, dict(attention, BLOCK_H=16, BLOCK_N=64, SPLIT=False), 4),
        ("decode_split", decode._decode_kernel, dict(attention, BLOCK_H=16, BLOCK_N=64, SPLIT=True), 4),
        ("merge", decode._merge_kernel, dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_S=64), 4),
        ("prefill", prefill._prefill_kernel, dict(attention, BLOCK_M=64, BLOCK_N=64), 4),
        ("kv_write", kv_write._kv_write_kernel, dict(ROW=1024, BLOCK=1024), 4),
        ("rms_norm", layer_ops._add_rms_norm_kernel, dict(N=4096, BLOCK=4096, HAS_RESIDUAL=False), 16),
        ("add_rms_norm", layer_ops._add_rms_norm_kernel, dict(N=4096, BLOCK=4096, HAS_RESIDUAL=True), 16),
        ("rope", layer_ops._rope_kernel, dict(NUM_HEADS=40, HALF=64, BLOCK_H=64, BLOCK_HALF=64), 4),
        ("silu_mul", layer_ops._silu_mul_kernel, dict(N=14336, BLOCK=1024), 4),
    ]


def compile_for_hopper(lazy, dtype: str, constexprs: dict, num_warps: int):
    fn = lazy.jit() if hasattr(lazy, "jit") else lazy  # lazy_jit kernels, or ones already jitted
    names = fn.arg_names
    signature = {n: "constexpr" if n in constexprs else arg_type(n, dtype) for n in names}
    source = ASTSource(fn=fn, signature=signature, constexprs={(names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(source, target=HOPPER, options={"num_warps": num_warps})


def main(dtypes: list[str]) -> int:
    failures = 0
    for dtype in dtypes:
        for name, lazy, constexprs, num_warps in kernels(dtype):
            t0 = time.perf_counter()
            try:
                compiled = compile_for_hopper(lazy, dtype, constexprs, num_warps)
                print(f"ok   {dtype:5} {name:13} {time.perf_counter() - t0:5.1f} s, "
                      f"shared memory {compiled.metadata.shared} B")
            except Exception as exc:  # report every kernel, not only the first failure
                failures += 1
                print(f"FAIL {dtype:5} {name:13} {type(exc).__name__}: {exc}")
    print(f"triton {triton.__version__}: {failures} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["bf16"]))
