"""The seams between the model and its kernels: `LayerOps` (a layer's elementwise ops: residual add +
RMSNorm, rotary, SwiGLU) and `AttentionFn`, each with the contract every backend keeps, and
`TorchLayerOps`, the plain-torch reference the C++ (cpu_layer_ops.py) and Triton (triton_backend.py)
ops are tested against and fall back to."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn.functional as F

if TYPE_CHECKING:  # types only: kernels/ never imports the model at run time
    from iterserve.server.model.llama import RMSNorm
    from iterserve.server.model.rope import RotaryEmbedding


class LayerOps(Protocol):
    """A layer's elementwise ops. Implementations may write into their inputs where they say so (the
    C++ and Triton ones do), so callers hand on only what each op returns."""

    @staticmethod
    def add_rms_norm(norm: RMSNorm, x: torch.Tensor,
                     residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); without a residual, (norm(x), x)."""

    @staticmethod
    def rotary(rope: RotaryEmbedding, positions: torch.Tensor, qk: torch.Tensor) -> torch.Tensor:
        """qk ([num_tokens, heads, head_dim]) rotated by each token's position."""

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for gate_up = [gate | up] on the last dimension."""


class AttentionFn(Protocol):
    """One layer's attention over the paged KV cache: writes this step's k and v into the cache at the
    slots `meta` names, then attends each query to its request's cached context; returns
    [num_tokens, num_heads * head_dim]. CUDA-graph capture needs it to allocate nothing that depends on
    the step's values, only on shapes `meta` fixes."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: Any, scale: float) -> torch.Tensor: ...


class TorchLayerOps:
    """The layer's elementwise ops in plain torch: the reference, and the path for what the kernels do
    not serve (other dtypes, devices without them)."""

    @staticmethod
    def add_rms_norm(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None):
        if residual is not None:
            x = x + residual
        return norm(x), x

    @staticmethod
    def rotary(rope: RotaryEmbedding, positions: torch.Tensor, qk: torch.Tensor) -> torch.Tensor:
        return rope(positions, qk)

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
