"""Kernel-level sections of benchmarks/gpu.py: correctness on the device, copy bandwidth, the decode
and prefill kernels against their bandwidth / FLOP ceilings and against torch's SDPA.

Every timing is the median of several runs, each after a 1 GiB write that flushes the L2 cache (so
small shapes cannot run from cache) and that also hides the Python launch cost behind GPU work.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from iterserve.kernels.triton_decode_attention import choose_num_splits, decode_attention_triton
from iterserve.kernels.triton_kv_write import write_kv_triton
from iterserve.kernels.triton_layer_ops import add_rms_norm_triton, rotary_triton, silu_mul_triton
from iterserve.kernels.triton_prefill_attention import prefill_attention_triton
from iterserve.kernels.triton_reference import (
    add_rms_norm_reference,
    decode_attention_reference,
    prefill_attention_reference,
    rope_reference,
    silu_mul_reference,
    write_kv_reference,
)
from iterserve.server.runner.backends import num_sms


class Timer:
    def __init__(self, device: torch.device, iters: int):
        self.cuda = device.type == "cuda"
        self.iters = iters
        self.flush = torch.empty(2**30 if self.cuda else 1, dtype=torch.uint8, device=device)

    def median_ms(self, fn) -> float:
        fn()  # compiles on first use
        times = []
        for _ in range(self.iters):
            if self.cuda:
                self.flush.zero_()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return sorted(times)[len(times) // 2]


def _paged_cache(num_seqs, context_len, block_size, num_kv_heads, head_dim, dtype, device, gen):
    """A cache just big enough for the contexts, blocks handed out in a random order."""
    blocks_per_seq = -(-context_len // block_size)
    num_blocks = num_seqs * blocks_per_seq
    shape = (num_blocks * block_size, num_kv_heads, head_dim)
    k = torch.randn(shape, dtype=dtype, device=device, generator=gen)
    v = torch.randn(shape, dtype=dtype, device=device, generator=gen)
    perm = torch.randperm(num_blocks, device=device, generator=gen).to(torch.int32)
    return k, v, perm.view(num_seqs, blocks_per_seq)


def check_kernels(shape: dict, dtype, device) -> dict:
    """Each kernel on the device against its fp32 torch reference; small shapes, the model's heads."""
    gen = torch.Generator(device=device).manual_seed(0)
    h, kvh, d, bs = shape["heads"], shape["kv_heads"], shape["head_dim"], 16
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    results = {}

    contexts = [1, 37, 300]
    k_cache, v_cache, tables = _paged_cache(len(contexts), max(contexts), bs, kvh, d, dtype, device, gen)
    ctx = torch.tensor(contexts, dtype=torch.int32, device=device)
    q = torch.randn(len(contexts), h, d, dtype=dtype, device=device, generator=gen)
    index = torch.arange(len(contexts), dtype=torch.int32, device=device)
    expected = decode_attention_reference(q, k_cache, v_cache, index, tables, ctx, bs, d**-0.5)
    for splits in (1, 4):
        out = torch.empty_like(q)
        decode_attention_triton(q, k_cache, v_cache, out, index, tables, ctx, bs, d**-0.5, num_splits=splits)
        results[f"decode_splits{splits}_max_err"] = (out.float().cpu() - expected).abs().max().item()

    chunks = [(0, 70), (33, 40), (5, 1)]
    lens = torch.tensor([n for _, n in chunks], dtype=torch.int32, device=device)
    starts = (torch.cumsum(lens, 0) - lens).to(torch.int32)
    ctx = torch.tensor([p + n for p, n in chunks], dtype=torch.int32, device=device)
    k_cache, v_cache, tables = _paged_cache(len(chunks), int(ctx.max()), bs, kvh, d, dtype, device, gen)
    q = torch.randn(int(lens.sum()), h, d, dtype=dtype, device=device, generator=gen)
    out = torch.empty_like(q)
    prefill_attention_triton(q, k_cache, v_cache, out, starts, lens, ctx, tables, int(lens.max()), bs, d**-0.5)
    expected = prefill_attention_reference(q, k_cache, v_cache, starts, lens, ctx, tables, bs, d**-0.5)
    rows = sorted(expected)
    got = out[rows].float().cpu()
    results["prefill_max_err"] = (got - torch.stack([expected[r] for r in rows])).abs().max().item()

    kv = torch.randn(5, 2, kvh, d, dtype=dtype, device=device, generator=gen)
    slots = torch.tensor([3, 40, -1, 7, 0], device=device)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    write_kv_reference(kv[:, 0], kv[:, 1], want_k, want_v, slots)
    write_kv_triton(kv[:, 0], kv[:, 1], k_cache, v_cache, slots)
    results["kv_write_exact"] = bool(torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v))

    x = torch.randn(6, shape["hidden"], dtype=dtype, device=device, generator=gen)
    w = torch.rand(shape["hidden"], dtype=dtype, device=device, generator=gen) + 0.5
    got, _ = add_rms_norm_triton(x, x, w, 1e-5)
    want, _ = add_rms_norm_reference(x, x, w, 1e-5)
    results["rms_norm_max_err"] = (got.float() - want.float()).abs().max().item()
    qk = torch.randn(6, h + kvh, d, dtype=dtype, device=device, generator=gen)
    cos, sin = torch.rand(64, d, device=device, generator=gen), torch.rand(64, d, device=device, generator=gen)
    cos[:, d // 2:], sin[:, d // 2:] = cos[:, : d // 2], sin[:, : d // 2]
    pos = torch.tensor([0, 5, 63, 7, 7, 1], device=device)
    want = rope_reference(qk.clone(), pos, cos, sin)
    results["rope_max_err"] = (rotary_triton(qk, pos, cos, sin).float() - want).abs().max().item()
    gate_up = torch.randn(6, 2 * shape["hidden"], dtype=dtype, device=device, generator=gen)
    results["silu_mul_max_err"] = (silu_mul_triton(gate_up).float() - silu_mul_reference(gate_up)).abs().max().item()
    results["tolerance"] = tol
    results["all_ok"] = results["kv_write_exact"] and all(
        v <= tol * 4 for k, v in results.items() if k.endswith("_max_err"))
    return results


def copy_bandwidth(num_bytes: int, device, timer: Timer) -> dict:
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = timer.median_ms(lambda: dst.copy_(src))
    return {"bytes": num_bytes, "ms": ms, "gb_per_s": 2 * num_bytes / ms / 1e6}  # read + write


def _sdpa_contiguous(q, k, v, scale, causal=False):
    """SDPA as fast as torch runs it here: flash attention with native GQA where it can, else whatever
    backend torch picks, else K/V repeated per query head (which reads `group` times the bytes)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=causal,
                                                  enable_gqa=True), "flash_gqa"
    except (TypeError, RuntimeError):
        pass
    try:
        return F.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=causal,
                                              enable_gqa=True), "default_gqa"
    except (TypeError, RuntimeError):
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        return F.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=causal), "default_repeat_kv"


def decode_kernel(shapes: list[tuple[int, int]], shape: dict, dtype, device, timer: Timer, copy_gb_s: float) -> list:
    h, kvh, d, bs = shape["heads"], shape["kv_heads"], shape["head_dim"], 16
    scale, sms = d**-0.5, num_sms(device)
    gen = torch.Generator(device=device).manual_seed(1)
    rows = []
    for batch, context in shapes:
        k_cache, v_cache, tables = _paged_cache(batch, context, bs, kvh, d, dtype, device, gen)
        ctx = torch.full((batch,), context, dtype=torch.int32, device=device)
        q = torch.randn(batch, h, d, dtype=dtype, device=device, generator=gen)
        index = torch.arange(batch, dtype=torch.int32, device=device)
        out = torch.empty_like(q)
        splits = choose_num_splits(batch, kvh, context, sms)

        # run and the lambdas below only run before the `del`s that free the GPU memory each shape took
        def run(s=splits):
            decode_attention_triton(q, k_cache, v_cache, out, index, tables, ctx, bs, scale, num_splits=s)  # noqa: F821

        ms = timer.median_ms(run)
        kv_bytes = 2 * batch * context * kvh * d * k_cache.element_size()
        row = {"batch": batch, "context": context, "num_splits": splits, "ms": ms,
               "gb_per_s": kv_bytes / ms / 1e6}
        row["fraction_of_copy_bw"] = row["gb_per_s"] / copy_gb_s
        if splits > 1:
            row["unsplit_ms"] = timer.median_ms(lambda: run(1))
        # the same attention on contiguous [batch, heads, ctx, dim] tensors
        slots = (tables.long()[:, :, None] * bs + torch.arange(bs, device=device)).view(batch, -1)[:, :context]
        k4, v4 = (c[slots].transpose(1, 2).contiguous() for c in (k_cache, v_cache))
        del k_cache, v_cache
        q4 = q.view(batch, h, 1, d)
        ref, sdpa_kind = _sdpa_contiguous(q4, k4, v4, scale)
        row["max_abs_diff_vs_sdpa"] = (ref.view(batch, h, d).float() - out.float()).abs().max().item()
        row["sdpa_ms"] = timer.median_ms(lambda: _sdpa_contiguous(q4, k4, v4, scale))  # noqa: F821
        row["sdpa_kind"] = sdpa_kind
        row["speed_vs_sdpa"] = row["sdpa_ms"] / ms
        rows.append(row)
        del k4, v4, ref
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def prefill_kernel(shapes: list[tuple[int, int, int]], shape: dict, dtype, device, timer: Timer) -> list:
    """(num_seqs, tokens cached before, chunk): TFLOP/s, and SDPA (causal, contiguous) for fresh prefills."""
    h, kvh, d, bs = shape["heads"], shape["kv_heads"], shape["head_dim"], 16
    gen = torch.Generator(device=device).manual_seed(2)
    rows = []
    for num_seqs, past, chunk in shapes:
        k_cache, v_cache, tables = _paged_cache(num_seqs, past + chunk, bs, kvh, d, dtype, device, gen)
        lens = torch.full((num_seqs,), chunk, dtype=torch.int32, device=device)
        starts = (torch.arange(num_seqs, device=device) * chunk).to(torch.int32)
        ctx = lens + past
        q = torch.randn(num_seqs * chunk, h, d, dtype=dtype, device=device, generator=gen)
        out = torch.empty_like(q)
        ms = timer.median_ms(lambda: prefill_attention_triton(q, k_cache, v_cache, out, starts, lens, ctx, tables,
                                                              chunk, bs, d**-0.5))
        flops = 4 * num_seqs * chunk * (past + (chunk + 1) / 2) * h * d  # QK^T and PV over the causal part
        row = {"num_seqs": num_seqs, "past": past, "chunk": chunk, "ms": ms, "tflop_per_s": flops / ms / 1e9}
        if past == 0:
            q4 = q.view(num_seqs, chunk, h, d).transpose(1, 2)
            k4 = torch.randn(num_seqs, kvh, chunk, d, dtype=dtype, device=device, generator=gen)
            sdpa_ms = timer.median_ms(lambda: _sdpa_contiguous(q4, k4, k4, d**-0.5, causal=True))
            row.update(sdpa_ms=sdpa_ms, speed_vs_sdpa=sdpa_ms / ms,
                       sdpa_kind=_sdpa_contiguous(q4, k4, k4, d**-0.5, causal=True)[1])
        rows.append(row)
    return rows
