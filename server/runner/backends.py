"""Attention backends: which attention function, layer ops and metadata builder the model runner uses.

`torch` is the CPU product: paged attention in torch (the C++ decode kernel on CPU float32 and bfloat16) and the
layer's elementwise ops as C++ kernels (kernels/cpu_layer_ops.py: one call per fused op instead of
several torch ops, each with a fixed cost), both plain torch elsewhere. `triton` runs the Triton
kernels of kernels/; on CUDA that is the default, on CPU it needs the Triton interpreter
(TRITON_INTERPRET=1, what the tests use). The Triton modules are imported only when that backend is
chosen, so CPU-only installs without triton never touch them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from iterserve.kernels.cpu_layer_ops import CpuLayerOps
from iterserve.kernels.layer_ops import AttentionFn, LayerOps
from iterserve.kernels.paged_attention_torch import paged_attention
from iterserve.server.config import ATTENTION_BACKENDS
from iterserve.server.errors import InvalidRequestError
from iterserve.server.runner.step_inputs import build_torch_metadata


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    attention_fn: AttentionFn
    layer_ops: type[LayerOps]
    build_metadata: Callable  # (StepLayout, device) -> the metadata attention_fn reads


def resolve_backend_name(name: str, device: torch.device) -> str:
    """auto -> triton on CUDA, torch elsewhere; a Triton backend on CPU only under the interpreter."""
    if name not in ATTENTION_BACKENDS:
        raise InvalidRequestError("attention_backend", f"must be one of {ATTENTION_BACKENDS}, got {name!r}")
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if name == "triton":
        try:
            import triton  # noqa: F401
        except ImportError:
            raise InvalidRequestError("attention_backend", "triton is not installed (pip install triton)") from None
        from iterserve.kernels.triton_jit import interpreting

        if device.type != "cuda" and not interpreting():
            raise InvalidRequestError(
                "attention_backend",
                f"the Triton kernels need a CUDA device (or TRITON_INTERPRET=1, the slow interpreter used "
                f"by the tests); the device is {device.type}",
            )
    return name


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def _triton_parts():
    from iterserve.kernels.triton_backend import TritonLayerOps, triton_paged_attention
    from iterserve.server.runner.triton_step_inputs import TritonMetadataBuilder

    return triton_paged_attention, TritonLayerOps, TritonMetadataBuilder


def make_backend(name: str, device: torch.device, num_kv_heads: int) -> AttentionBackend:
    name = resolve_backend_name(name, device)
    if name == "torch":
        return AttentionBackend("torch", paged_attention, CpuLayerOps, build_torch_metadata)
    attention_fn, layer_ops, builder = _triton_parts()
    return AttentionBackend("triton", attention_fn, layer_ops, builder(num_kv_heads, num_sms(device)))
