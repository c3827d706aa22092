"""bf16 linear layers on AVX512-BF16 CPUs as a C++ kernel (csrc/bf16_linear.cpp), from weights packed once.

oneDNN's bf16 linear streams the weights at about half the memory's bandwidth at the few rows of a decode
step: a whole SmolLM2-135M step at 1-16 rows took 15-25 ms on a 2-core Zen 5, where reading its 270 MB
takes ~10. The kernel reads them once, in the order they lie, at every row count up to 8, and tiles 8
rows by 48 columns from cache above that, level with oneDNN's speed there (`python
benchmarks/cpu_linear.py --dtype bfloat16`). One packed copy of each weight serves every row count.

Served where the build has AVX512-BF16 (`-march=native` or the `x86-64-v4-bf16` prebuilt level) and the
CPU has no AMX, whose tile multiplies oneDNN uses and this kernel does not. Sums are fp32, rounded to
bf16 once, as oneDNN's are; the order of the additions differs, so results may differ from oneDNN's in
the last bf16 bit (bf16 engines agree as tests/test_bf16.py says, not bit for bit).

ITERSERVE_CPU_BF16_LINEAR=torch keeps oneDNN for every bf16 linear without building anything (the A/B
comparison and a kill switch). It is read when a model's weights are packed, not per call.
"""

from __future__ import annotations

import torch

from iterserve.kernels.cpu_extension import CppExtension, cpu_flags

ENV_VAR = "ITERSERVE_CPU_BF16_LINEAR"

_extension = CppExtension("iterserve_cpu_bf16_linear", "bf16_linear.cpp", ENV_VAR, "C++ CPU bf16 linear")


def available() -> bool:
    """Whether the kernel serves: not forced off, no AMX on this CPU, built/loaded with AVX512-BF16.

    The first call builds (or loads the cached build), which takes a while; later calls are cheap.
    """
    if "amx_bf16" in cpu_flags() or "avx512_bf16" not in cpu_flags():
        return False
    return _extension.available() and bool(_extension.loaded().supported())


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The kernel's layout of W [out_features, in_features] (bf16, in_features even); call only when
    `available()`."""
    return _extension.loaded().pack(weight.detach())


def packs(weight: torch.Tensor) -> bool:
    """Whether `pack` takes this weight: a 2-D CPU bf16 one with an even in_features."""
    return weight.dim() == 2 and weight.dtype == torch.bfloat16 and weight.is_cpu and weight.shape[1] % 2 == 0


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in_features] bf16 @ W^T (+ bias, fp32) -> [..., out_features] bf16."""
    rows = x.reshape(-1, x.shape[-1])
    y = _extension.loaded().linear(rows, packed, out_features, bias)
    return y.reshape(*x.shape[:-1], out_features)
