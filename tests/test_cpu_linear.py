"""The oneDNN packed-weight linear (server/model/cpu_linear.py) against F.linear at every row count,
and its wiring into the model and the model runner on CPU fp32 (and bf16 where the
CPU has it natively)."""

import pytest
import torch
import torch.nn.functional as F

from iterserve.server.model.cpu_linear import PackedLinear, cpu_has_native_bf16, onednn_packing_supported

pytestmark = pytest.mark.skipif(not onednn_packing_supported(torch.device("cpu"), torch.float32),
                                reason="this torch build has no oneDNN")


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 17, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_matches_f_linear(rows, with_bias):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 40, generator=gen)
    bias = torch.randn(96, generator=gen) if with_bias else None
    x = torch.randn(rows, 40, generator=gen)
    out = PackedLinear(weight, bias)(x)
    assert out.shape == (rows, 96) and out.dtype == torch.float32
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [0, 1, 5])
def test_a_released_weight_is_freed_and_never_needed(rows):
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(96, 40, generator=gen)
    x = torch.randn(rows, 40, generator=gen)
    expected = F.linear(x, weight)
    param = torch.nn.Parameter(weight.clone())
    linear = PackedLinear(param, release_unpacked=True)
    assert param.numel() == 0
    torch.testing.assert_close(linear(x), expected, rtol=1e-5, atol=1e-5)


def test_an_unreleased_weight_is_kept():
    weight = torch.nn.Parameter(torch.randn(8, 4))
    PackedLinear(weight)
    assert weight.shape == (8, 4)


def test_packed_linear_follows_its_weight_parameter_name():
    """Swapping it in for an nn.Linear keeps the parameter names, so state dicts do not change."""
    linear = torch.nn.Linear(8, 16, bias=False)
    module = torch.nn.Module()
    module.proj = linear
    before = set(module.state_dict())
    module.proj = PackedLinear(linear.weight)
    assert set(module.state_dict()) == before


def _tiny_config():
    from iterserve.server.model.model_config import ModelConfig

    return ModelConfig.from_hf_dict({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 32, "intermediate_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 100,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 64, "tie_word_embeddings": True,
    })


def test_a_model_built_off_the_meta_device_has_a_drawn_embedding():
    # the embedding skips its random init on the meta device only; built for real (as these tests build
    # it) an undrawn weight is whatever memory held, NaN included, which once failed the test below
    from iterserve.server.model.llama import LlamaForCausalLM

    weight = LlamaForCausalLM(_tiny_config(), attention_fn=None, max_positions=64).embed_tokens.weight
    assert torch.isfinite(weight).all() and 0.5 < weight.std().item() < 2.0
    with torch.device("meta"):
        assert LlamaForCausalLM(_tiny_config(), attention_fn=None, max_positions=64).embed_tokens.weight.is_meta


PROJECTIONS = (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"), ("mlp", "down_proj"))


@pytest.mark.parametrize("rows", [1, 5])
def test_packing_the_model_keeps_its_logits_and_projections(rows):
    from iterserve.server.model.llama import LlamaForCausalLM

    model = LlamaForCausalLM(_tiny_config(), attention_fn=None, max_positions=64)
    hidden = torch.randn(rows, 32)
    expected = model.compute_logits(hidden)
    inputs = {p: torch.randn(rows, getattr(getattr(model.layers[0], p[0]), p[1]).in_features) for p in PROJECTIONS}
    def outputs():
        return {(i, p): getattr(getattr(layer, p[0]), p[1])(inputs[p])
                for i, layer in enumerate(model.layers) for p in PROJECTIONS}

    before = outputs()
    model.pack_linears()
    for layer in model.layers:
        for owner, name in PROJECTIONS:
            assert isinstance(getattr(getattr(layer, owner), name), PackedLinear)
    for key, value in outputs().items():
        torch.testing.assert_close(value, before[key], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.compute_logits(hidden), expected, rtol=1e-5, atol=1e-5)
    assert model.embed_tokens.weight.shape == (100, 32)  # the tied LM head's weight is never released


@pytest.mark.parametrize("dtype,packed", [(torch.float32, True), (torch.bfloat16, cpu_has_native_bf16()),
                                          (torch.float16, False)])
def test_runner_packs_on_cpu_fp32_and_on_native_bf16(dtype, packed):
    from iterserve.server.runner.model_runner import ModelRunner

    runner = ModelRunner(_tiny_config(), None, torch.device("cpu"), dtype, max_model_len=64, block_size=16)
    assert (runner.model.packed_lm_head is not None) == packed


@pytest.mark.skipif(not cpu_has_native_bf16(), reason="bf16 weights are packed only where the CPU has bf16")
@pytest.mark.parametrize("rows", [1, 17, 64])
def test_packed_bf16_linear_matches_f_linear_in_fp32_within_bf16_rounding(rows):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 40, generator=gen).bfloat16()
    bias = torch.randn(96, generator=gen).bfloat16()
    x = torch.randn(rows, 40, generator=gen).bfloat16()
    out = PackedLinear(weight, bias)(x)
    assert out.dtype == torch.bfloat16
    # oneDNN accumulates in fp32 and rounds once: within one bf16 step (2^-8 relative) of the exact sum
    expected = F.linear(x.float(), weight.float(), bias.float())
    torch.testing.assert_close(out.float(), expected, rtol=2**-8, atol=1e-2)
