"""A decode step's whole Llama layer stack in one C++ call on the CPU (csrc/decode_stack.cpp).

Layer by layer from Python, a decode step makes about ten calls a layer (norms, projections, rotary,
the K/V write, attention, SwiGLU), each with its Python, pybind and torch-dispatch cost of ~10-30 us,
and three nn.Module calls around them: profiled with py-spy on a 2-core Zen 5, that was over a third of
a one-request SmolLM2 step, whose kernels take ~13 ms. vLLM's CPU build removes the same cost with
torch.compile. Here the step's layers run from C++: the same kernels of the other CPU modules (their
function tables, csrc/c_api.h), in the same order and with the same arguments, so the result is the
one of the layer-by-layer path bit for bit; only the calls between them are gone.

Served where every kernel of the layer is: bf16 projections in the AVX512-BF16 linear kernel
(kernels/cpu_bf16_linear.py), the C++ layer ops and decode attention, a plain Llama layer (no q/k
norms, sliding window or soft-cap), and a decode-only step (one query per request, in request order).
Every other step, and every other model, runs layer by layer (server/model/llama.py decides).

ITERSERVE_CPU_DECODE_STACK=torch runs every step layer by layer without building anything: the A/B
comparison and a kill switch, read on every step, as are the switches of the kernels it calls
(ITERSERVE_CPU_LAYER_OPS, ITERSERVE_CPU_ATTENTION), which turn it off too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from iterserve.kernels import cpu_bf16_linear, cpu_layer_ops, cpu_paged_attention
from iterserve.kernels.cpu_extension import CppExtension

ENV_VAR = "ITERSERVE_CPU_DECODE_STACK"

_extension = CppExtension("iterserve_cpu_decode_stack", "decode_stack.cpp", ENV_VAR, "C++ CPU decode stack")


def available() -> bool:
    """Whether the stack serves: neither it nor a kernel it calls forced off, and all of them built/loaded.
    (The bf16 linear's switch is read when weights are packed: a stack exists only over packed weights.)"""
    return (_extension.available() and cpu_layer_ops.available() and cpu_paged_attention.available()
            and cpu_bf16_linear.available())


@dataclass
class StackLayer:
    """What one layer hands the stack: norm weights, projections packed by cpu_bf16_linear.pack (biases
    fp32 or None), and its rotary cos/sin caches (fp32 [max_positions, head_dim])."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    gate_up: torch.Tensor
    down: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor


class DecodeStack:
    """The C++ stack over a model's layers; `forward` runs a decode-only step through all of them."""

    def __init__(self, layers: list[StackLayer], final_norm: torch.Tensor, eps: float, num_heads: int,
                 num_kv_heads: int, head_dim: int, hidden_size: int, intermediate_size: int, scale: float):
        """Call only when `available()`. The tensors are held, not copied: the model must not move them."""
        stack_module = _extension.loaded()
        self._stack = stack_module.DecodeStack(
            cpu_layer_ops._extension.loaded().c_api, cpu_bf16_linear._extension.loaded().c_api,
            cpu_paged_attention._extension.loaded().c_api,
            [layer.input_norm for layer in layers], [layer.post_norm for layer in layers],
            [layer.qkv for layer in layers], [layer.qkv_bias for layer in layers],
            [layer.o for layer in layers], [layer.o_bias for layer in layers],
            [layer.gate_up for layer in layers], [layer.down for layer in layers],
            [layer.cos for layer in layers], [layer.sin for layer in layers], final_norm, eps,
            num_heads, num_kv_heads, head_dim, hidden_size, intermediate_size, scale)

    @staticmethod
    def serves(x: torch.Tensor, k_cache: torch.Tensor) -> bool:
        """Whether this step may run here: bf16 activations and cache (what the packed weights take) and
        `available()` (kill switches, read every step)."""
        return x.dtype == torch.bfloat16 and k_cache.dtype == torch.bfloat16 and available()

    def forward(self, x: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """x: the embedded tokens [n, hidden] of a decode-only step (one per request, in request order);
        the rest as that step's attention metadata holds them. Writes the step's K/V into the caches and
        returns the final norm's output [n, hidden]."""
        return self._stack.forward(x, positions, slot_mapping, block_tables, context_lens, block_size,
                                   [kv[0] for kv in kv_caches], [kv[1] for kv in kv_caches])
