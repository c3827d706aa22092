"""ModelConfig read from config.json shapes the released Qwen3, Phi-3 and Gemma checkpoints use (the
fields that decide the network, as their hub configs spell them, in the older transformers 4 form)."""

from __future__ import annotations

import pytest

from iterserve.server.model.model_config import ModelConfig

COMMON = dict(vocab_size=1000, max_position_embeddings=8192, rms_norm_eps=1e-6, bos_token_id=2, eos_token_id=1)
GEMMA2_2B = dict(COMMON, architectures=["Gemma2ForCausalLM"], model_type="gemma2", hidden_size=2304,
                 intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
                 head_dim=256, hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh",
                 query_pre_attn_scalar=256, sliding_window=4096, attn_logit_softcapping=50.0,
                 final_logit_softcapping=30.0, rope_theta=10000.0, cache_implementation="hybrid")
GEMMA3_1B = dict(COMMON, architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", hidden_size=1152,
                 intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1,
                 head_dim=256, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256,
                 sliding_window=512, sliding_window_pattern=6, rope_theta=1_000_000.0, rope_local_base_freq=10000.0,
                 rope_scaling=None, attn_logit_softcapping=None, final_logit_softcapping=None)
PHI3_MINI_4K = dict(COMMON, architectures=["Phi3ForCausalLM"], model_type="phi3", hidden_size=3072,
                    intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                    hidden_act="silu", max_position_embeddings=4096, original_max_position_embeddings=4096,
                    sliding_window=2047, rope_scaling=None, rope_theta=10000.0, tie_word_embeddings=False)
QWEN3_06B = dict(COMMON, architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=1024,
                 intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=128, hidden_act="silu", use_sliding_window=False, sliding_window=None,
                 max_window_layers=28, attention_bias=False, tie_word_embeddings=True, rope_theta=1_000_000.0)


def test_gemma2_alternates_local_and_global_layers():
    c = ModelConfig.from_hf_dict(GEMMA2_2B)
    assert [c.layer_window(i) for i in range(4)] == [4096, None, 4096, None]
    assert c.context_len == 8192 and c.needs_masked_attention and c.tie_word_embeddings and not c.qk_norm
    assert (c.attn_logit_softcapping, c.final_logit_softcapping, c.query_pre_attn_scalar) == (50.0, 30.0, 256)
    assert c.local_rope_theta is None


def test_gemma3_five_local_layers_then_a_global_one():
    c = ModelConfig.from_hf_dict(GEMMA3_1B)
    assert [c.layer_window(i) for i in range(7)] == [512] * 5 + [None, 512]
    assert (c.rope_theta, c.local_rope_theta, c.rope_scaling) == (1e6, 1e4, None)
    assert c.qk_norm and c.attn_logit_softcapping is None and c.final_logit_softcapping is None
    scaled = ModelConfig.from_hf_dict(dict(GEMMA3_1B, rope_scaling={"rope_type": "linear", "factor": 8.0}))
    assert scaled.rope_scaling == {"rope_type": "linear", "factor": 8.0} and scaled.local_rope_theta == 1e4


def test_phi3_window_caps_the_context_and_longrope_keeps_the_original_length():
    c = ModelConfig.from_hf_dict(PHI3_MINI_4K)
    assert c.context_len == 2047 and c.layer_types is None and not c.needs_masked_attention
    long = ModelConfig.from_hf_dict(dict(PHI3_MINI_4K, max_position_embeddings=131072, sliding_window=262144,
                                         rope_scaling={"type": "su", "short_factor": [1.0] * 48,
                                                       "long_factor": [2.0] * 48}))
    assert long.rope_scaling["rope_type"] == "longrope" and long.context_len == 4096


def test_qwen3_has_q_k_norms_and_no_biases():
    c = ModelConfig.from_hf_dict(QWEN3_06B)
    assert c.qk_norm and not c.attention_bias and not c.o_proj_bias and c.sliding_window is None
    assert c.head_dim == 128 and c.tie_word_embeddings


@pytest.mark.parametrize("change, message", [
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type 'dynamic' is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act: 'gelu' is not supported for Phi3ForCausalLM"),
    ({"partial_rotary_factor": 0.75}, "partial_rotary_factor"),
    ({"architectures": ["Phi3SmallForCausalLM"]}, "'Phi3SmallForCausalLM' is not supported; supported: .*Gemma3"),
])
def test_what_is_not_implemented_is_refused_by_name(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_dict(dict(PHI3_MINI_4K, **change))
