"""The C++ CPU layer ops (CpuLayerOps) in bfloat16: each op against an fp32 reference computed from the
same bf16 inputs, which inputs they write, and a whole bf16 model against fp32 beside TorchLayerOps."""

from __future__ import annotations

import collections

import pytest
import torch

from iterserve.kernels import cpu_layer_ops, cpu_paged_attention
from iterserve.kernels.cpu_layer_ops import CpuLayerOps
from iterserve.kernels.layer_ops import TorchLayerOps
from iterserve.kernels.paged_attention_torch import paged_attention
from iterserve.server.model.llama import LlamaForCausalLM
from iterserve.server.model.rope import RotaryEmbedding
from tests.bf16_support import assert_rounded_once_to_bf16
from tests.test_cpu_layer_ops import _config, _model_steps, _norm, _qkv, _step, kernel  # noqa: F401  (kernel: a fixture)

pytestmark = pytest.mark.usefixtures("kernel")  # each test skips when the kernels did not build

def _rms_norm_fp32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.nn.functional.rms_norm(x.float(), weight.shape, weight.float(), eps)


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("hidden", [36, 64, 576])
@pytest.mark.parametrize("rows", [1, 8, 64, 0])
def test_add_rms_norm_bf16(rows, hidden, with_residual, weight_dtype):
    gen = torch.Generator().manual_seed(rows * 1000 + hidden)
    norm = _norm(hidden, gen).to(weight_dtype)
    x = (torch.randn(rows, hidden, generator=gen) * 3).bfloat16()
    residual = torch.randn(rows, hidden, generator=gen).bfloat16() if with_residual else None
    x_before = x.clone()
    # torch's bf16 add rounds the fp32 sum once, as the kernel does: bit-equal
    expected_sum = x + residual if with_residual else x.clone()
    out, summed = CpuLayerOps.add_rms_norm(norm, x, residual)
    assert torch.equal(x, x_before)  # x is only read
    assert summed is (residual if with_residual else x)  # the stream, written in place
    assert summed.dtype == torch.bfloat16 and torch.equal(summed, expected_sum)
    assert out.shape == (rows, hidden) and out.dtype == torch.bfloat16
    assert_rounded_once_to_bf16(out, _rms_norm_fp32(expected_sum, norm.weight, norm.eps))


def test_add_rms_norm_bf16_reads_strided_rows():
    gen = torch.Generator().manual_seed(8)
    norm = _norm(576, gen).bfloat16()
    x = torch.randn(5, 600, generator=gen).bfloat16()[:, :576]
    residual = torch.randn(5, 590, generator=gen).bfloat16()[:, 10:586]
    backing = residual._base
    expected_sum = x + residual
    out, summed = CpuLayerOps.add_rms_norm(norm, x, residual)
    assert torch.equal(summed, expected_sum) and torch.equal(backing[:, 10:586], expected_sum)
    assert_rounded_once_to_bf16(out, _rms_norm_fp32(expected_sum, norm.weight, norm.eps))


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (9, 3, 32), (2, 1, 8)])
@pytest.mark.parametrize("num_tokens", [1, 8, 64, 0])
def test_rotary_bf16_rotates_q_and_k_in_place(heads, kv_heads, head_dim, num_tokens):
    cfg = _config(num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim)
    rope = RotaryEmbedding(cfg, 512)  # cos/sin stay fp32, as the model keeps them
    gen = torch.Generator().manual_seed(num_tokens + head_dim)
    qkv, _ = _qkv(num_tokens, heads, kv_heads, head_dim, gen)
    qkv = qkv.bfloat16()
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(num_tokens, heads + kv_heads, head_dim)  # strided rows
    before = qkv.clone()
    positions = torch.randint(0, 512, (num_tokens,), generator=gen)
    expected = TorchLayerOps.rotary(rope, positions, qk.float())  # fp32 from the same bf16 inputs
    assert CpuLayerOps.rotary(rope, positions, qk) is qk
    assert qk.dtype == torch.bfloat16
    assert_rounded_once_to_bf16(qk, expected)
    v_cols = (heads + kv_heads) * head_dim
    assert torch.equal(qkv[:, v_cols:], before[:, v_cols:])  # v is untouched


@pytest.mark.parametrize("d", [1, 36, 64, 576, 1536])
@pytest.mark.parametrize("rows", [1, 8, 64, 0])
def test_silu_mul_bf16(rows, d):
    gen = torch.Generator().manual_seed(rows + d)
    gate_up = (torch.randn(rows, 2 * d, generator=gen) * 6).bfloat16()
    before = gate_up.clone()
    out = CpuLayerOps.silu_mul(gate_up)
    assert out.shape == (rows, d) and out.dtype == torch.bfloat16
    assert_rounded_once_to_bf16(out, TorchLayerOps.silu_mul(gate_up.float()))
    assert torch.equal(gate_up, before)


def test_silu_mul_bf16_extremes():
    gate = torch.tensor([-1e4, -100.0, -88.0, -20.0, -1e-30, 0.0, 1e-30, 20.0, 88.0, 100.0, 1e4,
                         float("inf"), float("nan")])
    gate_up = torch.cat([gate, torch.full_like(gate, 1.5)])[None, :].bfloat16()
    out = CpuLayerOps.silu_mul(gate_up)
    # the range, not the rounding: exp's clamp leaves ~1e-35 where torch underflows to 0
    torch.testing.assert_close(out.float(), TorchLayerOps.silu_mul(gate_up.float()), atol=1e-30, rtol=2**-7,
                               equal_nan=True)




class _Counting:
    """A built extension module that counts the calls made through it in bf16 (by its first argument)."""

    def __init__(self, module):
        self.module, self.calls = module, collections.Counter()

    def __getattr__(self, name):
        fn = getattr(self.module, name)

        def call(first, *args, **kwargs):
            self.calls[name] += first.dtype == torch.bfloat16
            return fn(first, *args, **kwargs)
        return call


@torch.inference_mode()
def test_model_bf16_is_as_close_to_fp32_as_torch_layer_ops(monkeypatch):
    """The default model's layer shapes in bf16 (norm weights bf16, rope caches fp32, bf16 KV caches, so
    decodes take the C++ attention kernel too) with CpuLayerOps and with TorchLayerOps, each against the
    same model in fp32. The kernels round once per op where torch rounds after each op, so their bf16
    hidden states must be no further from fp32's than torch's are (with slack for how rounding errors
    happen to meet), and both within bf16's precision of it."""
    cfg = _config()
    reference = LlamaForCausalLM(cfg, paged_attention, 256, TorchLayerOps).eval()
    reference.init_dummy_weights(seed=0)
    models = [reference]
    for ops in (CpuLayerOps, TorchLayerOps):
        model = LlamaForCausalLM(cfg, paged_attention, 256, ops).eval()
        model.load_state_dict(reference.state_dict())
        model.to(torch.bfloat16)
        model.rope.build_cache()  # the model keeps cos/sin in fp32
        models.append(model)
    assert models[1].rope.cos_cache.dtype == torch.float32
    monkeypatch.delenv(cpu_paged_attention.ENV_VAR, raising=False)
    assert cpu_paged_attention.available()
    counted = {}
    for ext in (cpu_layer_ops._extension, cpu_paged_attention._extension):
        counted[ext.name] = _Counting(ext.module)
        monkeypatch.setattr(ext, "module", counted[ext.name])
    block_size, tables, shape, steps = _model_steps(cfg)
    caches = [[(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(cfg.num_hidden_layers)]
              for dtype in (torch.float32, torch.bfloat16, torch.bfloat16)]
    for done, new in steps:
        ids, positions, meta = _step(done, new, tables, block_size)
        expected, kernel_bf16, torch_bf16 = (m(ids, positions, c, meta) for m, c in zip(models, caches, strict=True))
        assert kernel_bf16.dtype == torch_bf16.dtype == torch.bfloat16
        kernel_err = (kernel_bf16.float() - expected).abs().max().item()
        torch_err = (torch_bf16.float() - expected).abs().max().item()
        scale = expected.abs().max().item()
        assert kernel_err <= 1.5 * torch_err and kernel_err <= 2**-6 * scale, (kernel_err, torch_err, scale)
    # the bf16 runs took the kernels: per layer and step, two norms, a rotary and a SwiGLU (CpuLayerOps
    # only), and in both a KV write and a decode attention (the prefill step's one-token prompt included)
    calls = 2 * cfg.num_hidden_layers * len(steps)
    assert counted[cpu_layer_ops._extension.name].calls == {"add_rms_norm": calls + len(steps),
                                                            "rotary": calls // 2, "silu_and_mul": calls // 2}
    assert counted[cpu_paged_attention._extension.name].calls == {"write_kv": calls,
                                                                  "paged_decode_attention": calls}
