"""Model loading: HF safetensors directories and GGUF files, checked against transformers' own loading."""

from __future__ import annotations

import json
import os

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from iterserve.server.model.gguf_loader import llama3_rope_divisors
from iterserve.server.model.loader import default_model_path, load_model, resolve_model_path
from iterserve.server.model.model_config import ModelConfig

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2)
FAMILIES = {
    "llama": (LlamaForCausalLM, LlamaConfig),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config),
    "mistral": (MistralForCausalLM, MistralConfig),
}


def save_tiny(path, family: str = "llama", dtype=torch.float32, **overrides) -> dict[str, torch.Tensor]:
    """Save a tiny random HF model to `path`; return its state dict."""
    model_cls, config_cls = FAMILIES[family]
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**TINY, **overrides}))
    # Fresh init leaves norms at 1 and biases at 0; randomize so a mix-up cannot compare equal.
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
    model.to(dtype).save_pretrained(path)
    return model.state_dict()


def assert_same_weights(weights: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert set(weights) == set(expected)
    for name, tensor in weights.items():
        assert tensor.dtype == torch.float32 and tensor.device.type == "cpu", name
        assert torch.equal(tensor, expected[name].float()), name


# ---------------------------------------------------------------- HF directories

@pytest.mark.parametrize(
    "family, overrides",
    [
        ("llama", {}),
        ("llama", {"tie_word_embeddings": True}),
        ("llama", {"attention_bias": True}),
        ("qwen2", {"tie_word_embeddings": True}),
        ("qwen2", {}),
        ("mistral", {"sliding_window": 16}),
    ],
)
def test_hf_round_trip(tmp_path, family, overrides):
    state = save_tiny(tmp_path, family, **overrides)
    loaded = load_model(str(tmp_path))
    tied = overrides.get("tie_word_embeddings", False)
    expected = {k: v for k, v in state.items() if not (tied and k == "lm_head.weight")}
    assert_same_weights(loaded.weights, expected)
    config = loaded.config
    assert config.tie_word_embeddings == tied
    assert config.attention_bias == (family == "qwen2" or overrides.get("attention_bias", False))
    assert config.sliding_window == overrides.get("sliding_window")
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 8)
    assert loaded.path == str(tmp_path) and loaded.source == f"hf:{tmp_path}"


def test_hf_bf16_checkpoint_loads_as_float32(tmp_path):
    state = save_tiny(tmp_path, dtype=torch.bfloat16)
    assert_same_weights(load_model(tmp_path).weights, {k: v.to(torch.bfloat16) for k, v in state.items()})


def test_hf_sharded_checkpoint(tmp_path):
    state = save_tiny(tmp_path, max_position_embeddings=64)
    model = LlamaForCausalLM(LlamaConfig(**TINY))
    model.load_state_dict(state)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").exists()
    assert_same_weights(load_model(sharded).weights, state)


def test_generation_config_adds_stop_tokens(tmp_path):
    save_tiny(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert load_model(tmp_path).config.eos_token_ids == [2, 7]


# ---------------------------------------------------------------- ModelConfig

BASE = {"architectures": ["LlamaForCausalLM"], **TINY, "rms_norm_eps": 1e-5, "max_position_embeddings": 128}


def test_config_defaults_and_rope_forms():
    legacy = ModelConfig.from_hf_dict({**BASE, "num_key_value_heads": None, "rope_theta": 5e5,
                                       "rope_scaling": {"type": "linear", "factor": 2.0}, "eos_token_id": 3})
    assert legacy.head_dim == 8 and legacy.num_key_value_heads == 4
    assert legacy.rope_theta == 5e5 and legacy.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert legacy.eos_token_ids == [3] and not legacy.tie_word_embeddings
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    v5 = ModelConfig.from_hf_dict({**BASE, "rope_parameters": {"rope_theta": 1e4, **llama3}, "eos_token_id": [1, 2]})
    assert v5.rope_theta == 1e4 and v5.rope_scaling == llama3 and v5.eos_token_ids == [1, 2]
    default = ModelConfig.from_hf_dict({**BASE, "rope_parameters": {"rope_theta": 1e4, "rope_type": "default"}})
    assert default.rope_scaling is None


def test_config_qwen2_sliding_window_only_when_enabled():
    qwen = {**BASE, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 32}
    assert ModelConfig.from_hf_dict(qwen).sliding_window is None
    assert ModelConfig.from_hf_dict({**qwen, "use_sliding_window": True, "max_window_layers": 0}).sliding_window == 32
    # transformers applies it only from layer max_window_layers on: here to no layer at all.
    late_window = {**qwen, "use_sliding_window": True, "max_window_layers": 28}
    assert ModelConfig.from_hf_dict(late_window).sliding_window is None
    with pytest.raises(ValueError, match="sliding_window"):
        ModelConfig.from_hf_dict({**qwen, "use_sliding_window": True, "max_window_layers": 1})


@pytest.mark.parametrize(
    "change, field",
    [
        ({"hidden_size": None}, "hidden_size"),
        ({"intermediate_size": None}, "intermediate_size"),
        ({"rms_norm_eps": None}, "rms_norm_eps"),
        ({"vocab_size": -1}, "vocab_size"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"eos_token_id": "x"}, "eos_token_id"),
        ({"rope_scaling": {"type": "linear"}}, "rope_scaling"),
    ],
)
def test_config_invalid_field_is_named(change, field):
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf_dict({**BASE, **change})


def test_config_unsupported_architecture_lists_supported():
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"):
        ModelConfig.from_hf_dict({**BASE, "architectures": ["GPT2LMHeadModel"]})


# ---------------------------------------------------------------- GGUF

def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to Llama q/k rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, arch: str, state: dict[str, torch.Tensor], permute: bool, theta: float = 1e4, **extra) -> None:
    """Write an HF state dict as a GGUF the way llama.cpp's converter names (and permutes) it."""
    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
             "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(TINY["num_hidden_layers"])
    writer.add_context_length(128)
    writer.add_embedding_length(TINY["hidden_size"])
    writer.add_feed_forward_length(TINY["intermediate_size"])
    writer.add_head_count(TINY["num_attention_heads"])
    writer.add_head_count_kv(TINY["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(theta)
    writer.add_eos_token_id(2)
    for key, value in extra.items():
        getattr(writer, f"add_{key}")(value)
    for hf_name, tensor in state.items():
        data = tensor.float().numpy()
        if hf_name == "model.embed_tokens.weight":
            name = "token_embd.weight"
        elif hf_name == "model.norm.weight":
            name = "output_norm.weight"
        elif hf_name == "lm_head.weight":
            name = "output.weight"
        elif not hf_name.startswith("model."):
            name = hf_name  # already a GGUF name (rope_freqs.weight)
        else:
            _, _, layer, *module, suffix = hf_name.split(".")
            kind = names[module[-1]]
            name = f"blk.{layer}.{kind}.{suffix}"
            if permute and kind in ("attn_q", "attn_k"):
                heads = TINY["num_attention_heads"] if kind == "attn_q" else TINY["num_key_value_heads"]
                data = llama_cpp_permute(data, heads)
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def default_model():
    return load_model(None)


def test_default_model_config(default_model):
    c = default_model.config
    assert default_model.path == default_model_path() and default_model.source.startswith("gguf:")
    assert c.architecture == "LlamaForCausalLM"
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads) == (30, 576, 9, 3)
    assert (c.vocab_size, c.head_dim, c.intermediate_size, c.tie_word_embeddings) == (49152, 64, 1536, True)
    assert c.eos_token_ids == [2] and c.bos_token_id == 1 and c.rope_theta == 100000.0 and c.rope_scaling is None
    assert "lm_head.weight" not in default_model.weights


def test_default_model_matches_transformers_gguf_loading(default_model):
    """transformers' GGUF loader (what from_pretrained(gguf_file=...) calls; calling that directly also
    needs `accelerate`) undoes the q/k permutation independently of ours: every tensor must match."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = os.path.split(default_model.path)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder, gguf_file=name))
    reference = load_gguf_checkpoint(default_model.path, return_tensors=True, model_to_load=skeleton)["tensors"]
    assert_same_weights(default_model.weights, reference)


def test_gguf_llama_q_k_are_unpermuted(tmp_path):
    state = save_tiny(tmp_path / "hf")
    write_gguf(tmp_path / "m.gguf", "llama", state, permute=True)
    loaded = load_model(tmp_path / "m.gguf")
    assert_same_weights(loaded.weights, state)
    assert not loaded.config.tie_word_embeddings and not loaded.config.attention_bias


def test_gguf_qwen2_biases_tied(tmp_path):
    state = save_tiny(tmp_path / "hf", "qwen2", tie_word_embeddings=True)
    del state["lm_head.weight"]
    write_gguf(tmp_path / "m.gguf", "qwen2", state, permute=False)
    loaded = load_model(tmp_path)  # a directory holding exactly one .gguf
    assert_same_weights(loaded.weights, state)
    assert loaded.config.architecture == "Qwen2ForCausalLM" and loaded.config.attention_bias
    assert loaded.config.tie_word_embeddings


def test_gguf_rope_scaling(tmp_path):
    state = save_tiny(tmp_path / "hf", tie_word_embeddings=True)
    del state["lm_head.weight"]
    write_gguf(tmp_path / "linear.gguf", "llama", state, permute=True,
               rope_scaling_type=gguf.RopeScalingType.LINEAR, rope_scaling_factor=4.0)
    assert load_model(tmp_path / "linear.gguf").config.rope_scaling == {"rope_type": "linear", "factor": 4.0}

    llama3 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    # A large theta makes this tiny head_dim span all three llama3 bands (kept, smoothed, scaled).
    divisors = llama3_rope_divisors(llama3, 5e5, 8)
    assert divisors[0] == 1.0 and divisors[-1] == 32.0 and 1.0 < divisors[-2] < 32.0
    state["rope_freqs.weight"] = divisors
    write_gguf(tmp_path / "llama3.gguf", "llama", state, permute=True, theta=5e5)
    assert load_model(tmp_path / "llama3.gguf").config.rope_scaling == llama3
    # Divisors that llama3 parameters cannot produce are refused, not guessed at.
    write_gguf(tmp_path / "other.gguf", "llama", state, permute=True, theta=1e4)
    with pytest.raises(ValueError, match="rope_freqs"):
        load_model(tmp_path / "other.gguf")


# ---------------------------------------------------------------- errors

def test_default_model_path_is_the_bundled_gguf():
    path = default_model_path()
    assert os.path.isfile(path) and path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert resolve_model_path(None) == ("gguf", path)


def test_nonexistent_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=f"model: {missing}"):
        load_model(missing)


def test_directory_without_model(tmp_path):
    with pytest.raises(ValueError, match="model: .*neither config.json"):
        load_model(tmp_path)
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="several .gguf"):
        load_model(tmp_path)


def test_config_without_weights(tmp_path):
    save_tiny(tmp_path)
    os.remove(tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="no .safetensors"):
        load_model(tmp_path)


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_safetensors(tmp_path, damage):
    save_tiny(tmp_path)
    file = tmp_path / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2] if damage == "truncate" else os.urandom(len(data)))
    with pytest.raises(ValueError, match="model: .*model.safetensors could not be read: "):
        load_model(tmp_path)


def test_missing_and_misshapen_tensor(tmp_path):
    save_tiny(tmp_path)
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model: tensor model\.layers\.1\.mlp\.up_proj\.weight is missing"):
        load_model(tmp_path)
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 3)
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"up_proj\.weight .*shape \(3, 3\), expected \(48, 32\)"):
        load_model(tmp_path)


def test_bad_config_json(tmp_path):
    save_tiny(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError,
                       match="config.json: architectures: 'GPT2LMHeadModel' is not supported; supported: Llama"):
        load_model(tmp_path)
    del config["num_hidden_layers"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="num_hidden_layers: missing"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json could not be read"):
        load_model(tmp_path)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_corrupt_gguf(tmp_path, damage):
    state = save_tiny(tmp_path / "hf")
    good = tmp_path / "good.gguf"
    write_gguf(good, "llama", state, permute=True)
    data = good.read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes({"truncate": data[: len(data) - 100], "garbage": b"GGUF" + os.urandom(2000), "empty": b""}[damage])
    with pytest.raises(ValueError, match="model: GGUF file .*bad.gguf could not be read"):
        load_model(bad)


def test_gguf_unsupported_architecture_and_missing_metadata(tmp_path):
    state = save_tiny(tmp_path / "hf")
    write_gguf(tmp_path / "phi.gguf", "phi2", state, permute=False)
    with pytest.raises(ValueError, match="'phi2'.*supported: llama, qwen2"):
        load_model(tmp_path / "phi.gguf")

    writer = gguf.GGUFWriter(str(tmp_path / "bare.gguf"), "llama")
    writer.add_embedding_length(32)
    writer.add_head_count(4)
    writer.add_tensor("token_embd.weight", np.zeros((96, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="llama.feed_forward_length is missing"):
        load_model(tmp_path / "bare.gguf")
