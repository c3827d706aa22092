"""The decoder layer's elementwise ops fused in Triton: residual add + RMSNorm, rotary embedding, SwiGLU.

In torch each of these is several kernels (RMSNorm alone is seven in bf16); at a batch-1 decode step
they cost more than their bytes. Arithmetic is fp32 inside, rounded to the activation dtype where the
torch path rounds (after the residual add, after normalizing, after SiLU), so bf16 results match it.
"""

from __future__ import annotations

import torch
import triton.language as tl

from iterserve.kernels.triton_jit import lazy_jit, next_power_of_2

_ELEMENTWISE_BLOCK = 1024


@lazy_jit
def _add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, x_stride, residual_stride,
                         eps, N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * residual_stride + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * N + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x32 * x32, 0) / N + eps)
    normed = (x32 * inv_rms).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * N + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


@lazy_jit
def _rope_kernel(x_ptr, positions_ptr, cos_ptr, sin_ptr, x_stride_tok, x_stride_head, cos_stride,
                 NUM_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    j = tl.arange(0, BLOCK_HALF)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    # the caches hold cat(freqs, freqs): the first half has every frequency
    cos = tl.load(cos_ptr + pos * cos_stride + j, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + pos * cos_stride + j, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
    mask = (h < NUM_HEADS)[:, None] & (j < HALF)[None, :]
    first = x_ptr + token * x_stride_tok + h[:, None] * x_stride_head + j[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(first, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(first + HALF, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


@lazy_jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, gate_up_stride, N: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    gate = tl.load(gate_up_ptr + row * gate_up_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * gate_up_stride + N + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate * tl.sigmoid(gate)).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * N + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def _check_rows(t: torch.Tensor, name: str) -> None:
    if t.dim() != 2 or t.stride(1) != 1:
        raise ValueError(f"{name}: expected [rows, cols] with contiguous columns, got shape {tuple(t.shape)}")


def add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual); without a residual, (RMSNorm(x), x)."""
    _check_rows(x, "add_rms_norm_triton x")
    rows, n = x.shape
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if residual is None:
        summed, residual_arg, residual_stride = x, x, 0
    else:
        _check_rows(residual, "add_rms_norm_triton residual")
        summed, residual_arg, residual_stride = torch.empty_like(out), residual, residual.stride(0)
    if rows:
        block = next_power_of_2(n)
        _add_rms_norm_kernel[(rows,)](x, residual_arg, weight, out, summed, x.stride(0), residual_stride, eps,
                                      N=n, BLOCK=block, HAS_RESIDUAL=residual is not None,
                                      num_warps=min(16, max(1, block // 256)))
    return out, summed


def rotary_triton(qk: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor,
                  sin_cache: torch.Tensor) -> torch.Tensor:
    """Rotate qk ([num_tokens, heads, head_dim], head_dim contiguous) in place; returns it."""
    num_tokens, num_heads, head_dim = qk.shape
    if qk.stride(2) != 1 or not cos_cache.is_contiguous() or not sin_cache.is_contiguous():
        raise ValueError("rotary_triton: head_dim and the cos/sin caches must be contiguous")
    if num_tokens:
        half = head_dim // 2
        block_h = min(next_power_of_2(num_heads), 64)
        grid = (num_tokens, -(-num_heads // block_h))
        _rope_kernel[grid](qk, positions, cos_cache, sin_cache, qk.stride(0), qk.stride(1), cos_cache.stride(0),
                           NUM_HEADS=num_heads, HALF=half, BLOCK_H=block_h, BLOCK_HALF=next_power_of_2(half))
    return qk


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [rows, 2 * n] (gate first): [rows, n]."""
    _check_rows(gate_up, "silu_mul_triton gate_up")
    rows, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, n), dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = min(next_power_of_2(n), _ELEMENTWISE_BLOCK)
        _silu_mul_kernel[(rows, -(-n // block))](gate_up, out, gate_up.stride(0), N=n, BLOCK=block)
    return out
