"""oneDNN pre-packed weights for every linear layer of the model on the CPU in fp32.

MKL's sgemm (what `F.linear` runs) is slow on this project's AMD CPUs, which it does not give its
best code paths. oneDNN picks its kernels by the instruction sets the CPU has, and a weight reordered
once into its blocked layout saves the reorder at every call (vLLM's CPU backend does the same with
its `onednn_mm`). Measured with `python benchmarks/cpu_linear.py` (docs/benchmarks.md), a whole
SmolLM2-135M step (every weight once, streamed from memory): on an AVX-512 CPU (AMD Zen 5) oneDNN is
2-6x faster than MKL at every row count; on an AVX2 one (AMD Zen 3, torch 2.13) 1.3-1.4x at one row,
2.3-3x at two and three, 1.2-2x from four up. So every fp32 call goes through the packed weight, and
the unpacked copy of a projection is given back. (Cache-hot, one small projection at one row is
faster under MKL on Zen 3; a model's step never is.)

bf16 weights are packed too where the CPU multiplies bf16 natively (AVX-512 BF16 or AMX): there oneDNN's
bf16 kernels run about twice as fast as its fp32 ones at every row count from 16 up (64 x 576 x 1536
on 2-core Zen 5 VMs: ~900 against ~470 GFLOP/s on one, 280-360 against 170-180 on another), and still
faster at one row, so bf16 is what "auto" picks on such a CPU (server/engine/engine_factory.py).
Where the CPU has AVX512-BF16 but no AMX, bf16 weights go to the C++ kernel of kernels/cpu_bf16_linear.py
instead: oneDNN's bf16 reads the weights at half the memory's bandwidth at a decode step's few rows.
Without native bf16, oneDNN emulates it, several times slower than fp32. CUDA takes other paths.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from iterserve.kernels import cpu_bf16_linear
from iterserve.kernels.cpu_extension import cpu_flags

_PACK_BATCH_HINT = 64  # oneDNN chooses its blocked layout for this many rows; any row count works


@functools.cache
def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX-512 BF16 or AMX-BF16) and oneDNN uses it."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"}) and torch.backends.mkldnn.is_available() \
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def onednn_packing_supported(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cpu" or not torch.backends.mkldnn.is_available() \
            or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and cpu_has_native_bf16())


class PackedLinear(nn.Module):
    """y = x W^T + b through oneDNN's packed W.

    `release_unpacked`: the unpacked weight is never read again, so its storage is freed (the parameter
    stays, empty, under its name). Only for a weight nothing else shares (not a tied LM head).
    """

    packed: torch.Tensor  # the kernel's layout (in_kernel), else oneDNN's
    kernel_bias: torch.Tensor | None  # the bias in fp32, as the kernel adds it (in_kernel only)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, release_unpacked: bool = False):
        super().__init__()
        self.weight, self.bias = weight, bias  # shared with the module they came from, not copied
        self.out_features = weight.shape[0]
        # bf16 on an AVX512-BF16 CPU: the C++ kernel's own layout (kernels/cpu_bf16_linear.py), which reads
        # the weights at the memory's bandwidth at a decode step's few rows, where oneDNN reads at half
        self.in_kernel = cpu_bf16_linear.packs(weight) and cpu_bf16_linear.available()
        if self.in_kernel:
            self.packed = cpu_bf16_linear.pack(weight)
            self.kernel_bias = None if bias is None else bias.detach().float().contiguous()
        else:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_BATCH_HINT)
        if release_unpacked:
            weight.data = torch.empty(0, dtype=weight.dtype, device=weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.in_kernel:
            return cpu_bf16_linear.linear(x, self.packed, self.out_features, self.kernel_bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
