"""A Llama layer's elementwise ops on the CPU as C++ kernels (csrc/cpu_layer_ops.cpp): `CpuLayerOps`.

Every torch op has a fixed cost, dispatch plus an OpenMP region, of roughly 10-50 us whatever its size;
in a decode step of a few rows that cost, not the arithmetic, is what the layer's elementwise ops take.
In torch the residual add + RMSNorm is two ops (twice a layer), SwiGLU two plus a chunk, and the
rotate-half rotary five plus views (negate, cat, two multiplies, an add). Here each is one call making
one pass over its rows, as in vLLM's CPU backend (fused_add_rms_norm, silu_and_mul, rotary_embedding);
rows are split over torch's threads only when there are enough of them to pay for the fork.

Unlike TorchLayerOps, two ops write into their inputs. `rotary` rotates q and k in place inside the
qkv projection's output, as the Triton one does. `add_rms_norm` writes x + residual into `residual`, as
vLLM's fused_add_rms_norm does: it is the stream the layers hand on, which nothing else reads, so no
new tensor is needed. `x`, a fresh matmul output, is only read.

Built on first use by kernels/cpu_extension.py (cached per torch version and CPU; a failed build is
logged once and leaves TorchLayerOps serving). CPU float32 and bfloat16 tensors are served: the
arithmetic is fp32 either way, and a bf16 result is rounded once, on store, where torch's bf16 ops
round after each op (so bf16 results are as close to fp32's or closer, not bit-equal to TorchLayerOps';
the bf16 residual sum is). The RMSNorm weight may be fp32 or x's dtype; rotary's cos/sin caches must be
fp32, as the model keeps them. Other dtypes and devices take TorchLayerOps.
`first_max` is the greedy sampler's argmax, here because it is the same kind of kernel (one pass over
rows, fp32 or bf16) and one more library would be one more build: torch's max(dim=-1) reads bf16
logits at ~2.5 GB/s, 2.6 ms of a 64-row decode step over SmolLM2's 49k vocabulary.
ITERSERVE_CPU_LAYER_OPS=torch forces TorchLayerOps without building anything: the A/B comparison and a
kill switch, read on every call so it can be flipped in-process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from iterserve.kernels.cpu_extension import CppExtension
from iterserve.kernels.layer_ops import TorchLayerOps

if TYPE_CHECKING:  # types only: kernels/ never imports the model at run time
    from iterserve.server.model.llama import RMSNorm
    from iterserve.server.model.rope import RotaryEmbedding

ENV_VAR = "ITERSERVE_CPU_LAYER_OPS"

# no fused multiply-adds: the add and the rotary then round as torch's separate ops do (bit-identical)
_extension = CppExtension("iterserve_cpu_layer_ops", "cpu_layer_ops.cpp", ENV_VAR, "C++ CPU layer ops",
                          extra_cflags=("-ffp-contract=off",))


def available() -> bool:
    """Whether the kernels serve: not forced off by ITERSERVE_CPU_LAYER_OPS=torch, and built/loaded.

    The first call builds (or loads the cached build), which takes a while; later calls are cheap.
    """
    return _extension.available()


SERVED_DTYPES = (torch.float32, torch.bfloat16)


def _serves(t: torch.Tensor) -> bool:
    return t.dtype in SERVED_DTYPES and t.is_cpu and _extension.available()


class CpuLayerOps:
    """TorchLayerOps' interface, through the C++ kernels for CPU float32 and bfloat16 inputs."""

    @staticmethod
    def add_rms_norm(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None):
        """(norm(x + residual), x + residual), the sum written into `residual`; without a residual,
        (norm(x), x). Served when x and residual share a served dtype and the weight is fp32 or that."""
        if (not _serves(x) or (residual is not None and residual.dtype != x.dtype)
                or norm.weight.dtype not in (torch.float32, x.dtype)):
            return TorchLayerOps.add_rms_norm(norm, x, residual)
        return _extension.loaded().add_rms_norm(x, residual, norm.weight, norm.eps)

    @staticmethod
    def rotary(rope: RotaryEmbedding, positions: torch.Tensor, qk: torch.Tensor) -> torch.Tensor:
        """Rotate qk ([num_tokens, heads, head_dim], head_dim contiguous) in place; returns it. Served
        when qk's dtype is and the cos/sin caches are fp32."""
        if not _serves(qk) or rope.cos_cache.dtype != torch.float32 or rope.sin_cache.dtype != torch.float32:
            return TorchLayerOps.rotary(rope, positions, qk)
        _extension.loaded().rotary(qk, positions, rope.cos_cache, rope.sin_cache)
        return qk

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        if not _serves(gate_up):
            return TorchLayerOps.silu_mul(gate_up)
        return _extension.loaded().silu_and_mul(gate_up)


def first_max(logits: torch.Tensor) -> torch.Tensor:
    """The index of each row's first maximum (a NaN counted the largest), as `logits.max(dim=-1).indices`:
    int64 [rows]. Any 2-D logits; the kernel serves CPU float32 and bfloat16 rows with contiguous columns."""
    if logits.dim() != 2 or logits.shape[1] == 0 or logits.stride(1) != 1 or not _serves(logits):
        return logits.max(dim=-1).indices
    return _extension.loaded().first_max(logits)
