"""oneDNN pre-packed weights for the CPU's widest matmuls (the LM head and the fused gate/up).

On this project's AMD CPUs MKL's sgemm (what `F.linear` runs) is erratic for these shapes: the
SmolLM2 LM head ([49152, 576]) takes 20 ms at 8 rows under MKL and 8 ms under oneDNN with a weight
reordered once into its blocked layout (`python benchmarks/cpu_linear.py`; docs/benchmarks.md).
Below MIN_ROWS rows MKL is the faster of the two, so both weights are kept and each call picks one
by its row count. The other projections gain nothing measurable and stay on MKL, which bounds the
extra memory to those two weights. Only fp32 on the CPU: bf16 and CUDA take other paths.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

MIN_ROWS = 4  # from 4 rows up oneDNN beats MKL on both shapes; at 1 row MKL is ~1.4x faster
_PACK_BATCH_HINT = 64  # oneDNN chooses its blocked layout for this many rows; any row count works


def onednn_packing_supported(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class PackedLinear(nn.Module):
    """y = x W^T + b through oneDNN's packed W for MIN_ROWS rows or more, F.linear below that."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight, self.bias = weight, bias  # shared with the module they came from, not copied
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_BATCH_HINT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] >= MIN_ROWS:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
