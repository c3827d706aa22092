"""The C++ CPU layer ops (CpuLayerOps) against TorchLayerOps: each op at odd shapes, which inputs they
write, the ITERSERVE_CPU_LAYER_OPS kill switch and the other fallbacks (bfloat16's included), and a whole
model either way. Their bfloat16 arithmetic: test_cpu_layer_ops_bf16.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from iterserve.kernels import cpu_layer_ops
from iterserve.kernels.cpu_layer_ops import CpuLayerOps
from iterserve.kernels.layer_ops import TorchLayerOps
from iterserve.kernels.paged_attention_torch import paged_attention
from iterserve.server.model.llama import LlamaForCausalLM, RMSNorm
from iterserve.server.model.model_config import ModelConfig
from iterserve.server.model.rope import RotaryEmbedding
from iterserve.server.runner.step_inputs import StepLayout, build_torch_metadata

RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture
def kernel(monkeypatch):
    monkeypatch.delenv(cpu_layer_ops.ENV_VAR, raising=False)
    if not cpu_layer_ops.available():
        pytest.skip("the C++ layer ops did not build or load (their warning, logged by "
                    "iterserve.kernels.cpu_extension, says why)")


class _Refuse:
    def __getattr__(self, name):
        raise AssertionError(f"the C++ kernel {name} ran where the torch path should have")


@pytest.fixture
def refuse_kernel(monkeypatch):
    """The kernels count as built, but any call into them fails the test."""
    monkeypatch.setattr(cpu_layer_ops._extension, "module", _Refuse())
    monkeypatch.setattr(cpu_layer_ops._extension, "failed", False)


def _config(**overrides) -> ModelConfig:
    fields = dict(architecture="LlamaForCausalLM", vocab_size=320, hidden_size=576, intermediate_size=1536,
                  num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                  rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=512,
                  tie_word_embeddings=True, attention_bias=False, bos_token_id=None, eos_token_ids=[])
    return ModelConfig(**{**fields, **overrides})


def _norm(hidden: int, gen: torch.Generator) -> RMSNorm:
    norm = RMSNorm(hidden, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(hidden, generator=gen) + 0.5)
    return norm


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("hidden", [36, 64, 576])  # 36: not a multiple of any vector width
@pytest.mark.parametrize("rows", [1, 8, 64, 0])
def test_add_rms_norm(kernel, rows, hidden, with_residual):
    gen = torch.Generator().manual_seed(rows * 1000 + hidden)
    norm = _norm(hidden, gen)
    x = torch.randn(rows, hidden, generator=gen) * 3
    residual = torch.randn(rows, hidden, generator=gen) if with_residual else None
    x_before = x.clone()
    expected, expected_sum = TorchLayerOps.add_rms_norm(norm, x.clone(), None if residual is None else residual.clone())
    out, summed = CpuLayerOps.add_rms_norm(norm, x, residual)
    assert torch.equal(x, x_before)  # x is only read
    # the residual stream is written in place, rounded as torch's add rounds; without one, it is x
    assert summed is (residual if with_residual else x)
    torch.testing.assert_close(summed, expected_sum, atol=0, rtol=0)
    assert out.shape == (rows, hidden) and out.dtype == torch.float32
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)


def test_add_rms_norm_reads_strided_rows(kernel):
    gen = torch.Generator().manual_seed(7)
    norm = _norm(576, gen)
    x = torch.randn(5, 600, generator=gen)[:, :576]  # rows 600 apart
    residual = torch.randn(5, 590, generator=gen)[:, 10:586]
    expected, expected_sum = TorchLayerOps.add_rms_norm(norm, x, residual.clone())
    out, summed = CpuLayerOps.add_rms_norm(norm, x, residual)
    torch.testing.assert_close(summed, expected_sum, atol=0, rtol=0)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)


def _qkv(num_tokens: int, heads: int, kv_heads: int, head_dim: int, gen: torch.Generator):
    """qkv as the fused projection leaves it, and qk: the q and k heads viewed inside its rows."""
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, generator=gen)
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(num_tokens, heads + kv_heads, head_dim)
    return qkv, qk


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (9, 3, 32), (4, 4, 32), (2, 1, 8)])
@pytest.mark.parametrize("num_tokens", [1, 8, 64, 0])
@pytest.mark.parametrize("rope_scaling", [None, {"rope_type": "yarn", "factor": 4.0,
                                                 "original_max_position_embeddings": 128}])
def test_rotary_rotates_q_and_k_in_place(kernel, heads, kv_heads, head_dim, num_tokens, rope_scaling):
    cfg = _config(num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                  rope_scaling=rope_scaling)
    rope = RotaryEmbedding(cfg, 512)
    gen = torch.Generator().manual_seed(num_tokens + head_dim)
    qkv, qk = _qkv(num_tokens, heads, kv_heads, head_dim, gen)
    before = qkv.clone()
    positions = torch.randint(0, 512, (num_tokens,), generator=gen)  # any order, repeats allowed
    expected = TorchLayerOps.rotary(rope, positions, qk.clone())
    assert CpuLayerOps.rotary(rope, positions, qk) is qk
    # no fused multiply-adds: each product and the sum round as torch's separate ops do
    torch.testing.assert_close(qk, expected, atol=0, rtol=0)
    v_cols = (heads + kv_heads) * head_dim
    assert torch.equal(qkv[:, v_cols:], before[:, v_cols:])  # v is untouched


def test_rotary_int32_positions(kernel):
    rope = RotaryEmbedding(_config(), 64)
    _, qk = _qkv(6, 9, 3, 64, torch.Generator().manual_seed(1))
    positions = torch.tensor([5, 0, 63, 5, 17, 2], dtype=torch.int32)
    expected = TorchLayerOps.rotary(rope, positions, qk.clone())
    torch.testing.assert_close(CpuLayerOps.rotary(rope, positions, qk), expected, atol=0, rtol=0)


def test_rotary_refuses_a_position_past_the_cache_and_changes_nothing(kernel):
    rope = RotaryEmbedding(_config(), 64)
    qkv, qk = _qkv(3, 9, 3, 64, torch.Generator().manual_seed(2))
    before = qkv.clone()
    with pytest.raises(RuntimeError, match="outside the cache"):
        CpuLayerOps.rotary(rope, torch.tensor([1, 64, 2]), qk)
    assert torch.equal(qkv, before)


@pytest.mark.parametrize("d", [1, 36, 64, 576, 1536])
@pytest.mark.parametrize("rows", [1, 8, 64, 0])
def test_silu_mul(kernel, rows, d):
    gen = torch.Generator().manual_seed(rows + d)
    gate_up = torch.randn(rows, 2 * d, generator=gen) * 6
    before = gate_up.clone()
    out = CpuLayerOps.silu_mul(gate_up)
    assert out.shape == (rows, d) and out.dtype == torch.float32
    torch.testing.assert_close(out, TorchLayerOps.silu_mul(gate_up), atol=ATOL, rtol=RTOL)
    assert torch.equal(gate_up, before)


def test_silu_mul_extremes(kernel):
    gate = torch.tensor([-1e4, -100.0, -88.0, -20.0, -1e-30, 0.0, 1e-30, 20.0, 88.0, 100.0, 1e4,
                         float("inf"), float("nan")])
    gate_up = torch.cat([gate, torch.full_like(gate, 1.5)])[None, :]
    out = CpuLayerOps.silu_mul(gate_up)
    torch.testing.assert_close(out, TorchLayerOps.silu_mul(gate_up), atol=1e-30, rtol=RTOL, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
def test_kernels_refuse_other_dtypes(kernel, dtype):
    module = cpu_layer_ops._extension.module
    x = torch.randn(2, 8, dtype=dtype)
    with pytest.raises(RuntimeError, match="expected float32 or bfloat16"):
        module.silu_and_mul(x)
    with pytest.raises(RuntimeError, match="expected float32 or bfloat16"):
        module.add_rms_norm(x, None, torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="differs from x's"):
        module.add_rms_norm(x.float(), x.bfloat16(), torch.ones(8), 1e-5)
    rope = RotaryEmbedding(_config(head_dim=8), 16)
    with pytest.raises(RuntimeError, match="cos_cache: expected float32"):
        module.rotary(torch.randn(2, 1, 8).bfloat16(), torch.tensor([0, 1]), rope.cos_cache.bfloat16(),
                      rope.sin_cache.bfloat16())


def _call_all(dtype: torch.dtype):
    """Every op on inputs of `dtype`, with what TorchLayerOps returns for them (on copies)."""
    gen = torch.Generator().manual_seed(3)
    norm = _norm(64, gen).to(dtype)
    x, residual = torch.randn(4, 64, generator=gen).to(dtype), torch.randn(4, 64, generator=gen).to(dtype)
    rope = RotaryEmbedding(_config(head_dim=32), 64)
    _, qk = _qkv(4, 9, 3, 32, gen)
    qk, positions = qk.to(dtype), torch.tensor([3, 1, 4, 1])
    gate_up = torch.randn(4, 72, generator=gen).to(dtype)
    got = [*CpuLayerOps.add_rms_norm(norm, x, residual), CpuLayerOps.rotary(rope, positions, qk),
           CpuLayerOps.silu_mul(gate_up)]
    expected = [*TorchLayerOps.add_rms_norm(norm, x, residual), TorchLayerOps.rotary(rope, positions, qk),
                TorchLayerOps.silu_mul(gate_up)]
    return got, expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kill_switch_takes_the_torch_path(monkeypatch, refuse_kernel, dtype):
    monkeypatch.setenv(cpu_layer_ops.ENV_VAR, "torch")
    assert not cpu_layer_ops.available()
    got, expected = _call_all(dtype)
    for g, e in zip(got, expected, strict=True):
        assert g.dtype == dtype and torch.equal(g, e)


def test_mixed_dtypes_take_the_torch_path(monkeypatch, refuse_kernel):
    """bf16 x with an fp32 residual, an fp16 norm weight, bf16 cos/sin caches: not what the kernels take."""
    monkeypatch.delenv(cpu_layer_ops.ENV_VAR, raising=False)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(4, 64, generator=gen).bfloat16()
    norm = _norm(64, gen)
    out, summed = CpuLayerOps.add_rms_norm(norm, x, torch.randn(4, 64, generator=gen))
    assert summed.dtype == torch.float32
    CpuLayerOps.add_rms_norm(norm.half(), x, None)
    rope = RotaryEmbedding(_config(head_dim=32), 64).bfloat16()
    _, qk = _qkv(4, 9, 3, 32, gen)
    CpuLayerOps.rotary(rope, torch.tensor([3, 1, 4, 1]), qk.bfloat16())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
def test_other_dtypes_take_the_torch_path(monkeypatch, refuse_kernel, dtype):
    monkeypatch.delenv(cpu_layer_ops.ENV_VAR, raising=False)
    assert cpu_layer_ops.available()
    got, expected = _call_all(dtype)
    for g, e in zip(got, expected, strict=True):
        assert g.dtype == dtype and torch.equal(g, e)


def test_failed_build_falls_back_to_torch_and_warns_once(monkeypatch, caplog):
    def no_compiler():
        raise RuntimeError("no compiler here")

    monkeypatch.delenv(cpu_layer_ops.ENV_VAR, raising=False)
    monkeypatch.setattr(cpu_layer_ops._extension, "module", None)
    monkeypatch.setattr(cpu_layer_ops._extension, "failed", False)
    monkeypatch.setattr(cpu_layer_ops._extension, "_build", no_compiler)
    with caplog.at_level("WARNING", logger="iterserve.kernels"):
        assert not cpu_layer_ops.available()
        got, expected = _call_all(torch.float32)
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "no compiler here" in caplog.text
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g, e)


def _step(done: list[int], new: list[list[int]], tables: np.ndarray, block_size: int):
    """input_ids, positions and torch-path metadata of one step: request i has `done[i]` tokens cached
    and computes `new[i]`."""
    computed = np.array(done, dtype=np.int64)
    num_new = np.array([len(t) for t in new], dtype=np.int64)
    starts = np.cumsum(num_new) - num_new
    token_req = np.repeat(np.arange(len(new)), num_new)
    positions = np.arange(int(num_new.sum())) - starts[token_req] + computed[token_req]
    slots = tables[token_req, positions // block_size] * block_size + positions % block_size
    layout = StepLayout(block_size=block_size, input_ids=sum(new, []), positions=positions, slots=slots,
                        starts=starts, num_new=num_new, computed=computed, ends=computed + num_new,
                        tables=tables, sample_indices=np.zeros(0, dtype=np.int64), sampling=[])
    meta = build_torch_metadata(layout, torch.device("cpu"))
    return torch.tensor(layout.input_ids), torch.from_numpy(positions), meta


def _model_steps(cfg: ModelConfig):
    """Four prompts prefilled in one step, then three decode steps: (block_size, block tables, one KV
    cache's shape, the steps as (tokens done, new tokens) per request)."""
    block_size, lens = 16, [23, 1, 40, 7]
    # shuffled block ids, so a request's blocks are neither contiguous nor increasing
    tables = np.random.default_rng(0).permutation(4 * 8).reshape(4, 8).astype(np.int64)
    shape = (4 * 8 * block_size, cfg.num_key_value_heads, cfg.head_dim)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in lens]
    steps = [([0] * 4, prompts)] + [([n + i for n in lens], [[int(rng.integers(0, cfg.vocab_size))] for _ in lens])
                                    for i in range(3)]
    return block_size, tables, shape, steps


@torch.inference_mode()
def test_model_matches_torch_layer_ops(kernel):
    """Two prefill steps' worth of prompts, then decodes: hidden states and logits of the default
    model's layer shapes (2 layers) with either layer ops."""
    cfg = _config()
    models = []
    for ops in (CpuLayerOps, TorchLayerOps):
        model = LlamaForCausalLM(cfg, paged_attention, 256, ops).eval()
        model.init_dummy_weights(seed=0)
        models.append(model)
    block_size, tables, shape, steps = _model_steps(cfg)
    caches = [[(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_hidden_layers)] for _ in models]
    for done, new in steps:
        ids, positions, meta = _step(done, new, tables, block_size)
        hidden = [m(ids, positions, c, meta) for m, c in zip(models, caches, strict=True)]
        torch.testing.assert_close(hidden[0], hidden[1], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(models[0].compute_logits(hidden[0]), models[1].compute_logits(hidden[1]),
                                   atol=1e-5, rtol=1e-4)
