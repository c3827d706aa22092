"""The oneDNN packed-weight linear (server/model/cpu_linear.py) against F.linear, on both sides of
its row threshold, and its wiring into the model runner on CPU fp32."""

import pytest
import torch
import torch.nn.functional as F

from iterserve.server.model.cpu_linear import MIN_ROWS, PackedLinear, onednn_packing_supported

pytestmark = pytest.mark.skipif(not onednn_packing_supported(torch.device("cpu"), torch.float32),
                                reason="this torch build has no oneDNN")


@pytest.mark.parametrize("rows", [1, MIN_ROWS - 1, MIN_ROWS, 17, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_matches_f_linear(rows, with_bias):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 40, generator=gen)
    bias = torch.randn(96, generator=gen) if with_bias else None
    x = torch.randn(rows, 40, generator=gen)
    out = PackedLinear(weight, bias)(x)
    assert out.shape == (rows, 96) and out.dtype == torch.float32
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


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


def test_packing_the_model_keeps_its_logits():
    from iterserve.server.model.llama import LlamaForCausalLM

    model = LlamaForCausalLM(_tiny_config(), attention_fn=None, max_positions=64)
    hidden = torch.randn(MIN_ROWS + 1, 32)
    expected = model.compute_logits(hidden)
    model.pack_wide_linears()
    assert all(isinstance(layer.mlp.gate_up_proj, PackedLinear) for layer in model.layers)
    torch.testing.assert_close(model.compute_logits(hidden), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype,packed", [(torch.float32, True), (torch.bfloat16, False)])
def test_runner_packs_only_on_cpu_fp32(dtype, packed):
    from iterserve.server.runner.model_runner import ModelRunner

    runner = ModelRunner(_tiny_config(), None, torch.device("cpu"), dtype, max_model_len=64, block_size=16)
    assert (runner.model.packed_lm_head is not None) == packed
