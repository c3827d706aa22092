"""GGUF files of the families beyond Llama/Qwen2 (qwen3, phi3, gemma2, gemma3) load as the same model as
their HF checkpoint: same config, same tensors, and transformers' own GGUF reader agrees on every tensor."""

from __future__ import annotations

import dataclasses

import gguf
import pytest
import torch
import transformers as tf

from iterserve.server.model.loader import load_model

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, head_dim=8)
SPECIAL = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
FAMILIES = {
    "qwen3": lambda: tf.Qwen3ForCausalLM(tf.Qwen3Config(**TINY, tie_word_embeddings=True)),
    "phi3": lambda: tf.Phi3ForCausalLM(tf.Phi3Config(**TINY, **SPECIAL, sliding_window=64)),
    "gemma2": lambda: tf.Gemma2ForCausalLM(tf.Gemma2Config(**TINY, **SPECIAL, query_pre_attn_scalar=8,
                                                           sliding_window=16)),
    "gemma3": lambda: tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(
        **TINY, **SPECIAL, query_pre_attn_scalar=8, sliding_window=16, sliding_window_pattern=2)),
}


def write_family_gguf(path, arch: str, model, extra: dict[str, torch.Tensor] | None = None) -> None:
    """Write `model` as llama.cpp's convert_hf_to_gguf.py does: its metadata keys, gguf-py's tensor names,
    Gemma's norms stored as 1 + w."""
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    # transformers 5 keeps theta in rope_parameters (per layer type for Gemma 3, whose global theta is 1e6)
    theta = 1e6 if arch == "gemma3" else getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]
    writer.add_rope_freq_base(theta)
    writer.add_eos_token_id(2)
    writer.add_bos_token_id(1)
    if getattr(cfg, "sliding_window", None):
        writer.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if arch == "gemma3":
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    table = gguf.get_tensor_name_map(arch_id, cfg.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        data = tensor.float()
        if arch.startswith("gemma") and hf_name.endswith("norm.weight"):
            data = data + 1
        base, suffix = hf_name.rsplit(".", 1)
        writer.add_tensor(f"{table.get_name(base)}.{suffix}", data.numpy())
    for name, tensor in (extra or {}).items():
        writer.add_tensor(name, tensor.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_gguf_loads_as_the_hf_checkpoint(tmp_path, arch):
    torch.manual_seed(0)
    model = FAMILIES[arch]()
    with torch.no_grad():  # fresh init leaves norms at 0 or 1: randomize so a mix-up cannot compare equal
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
    model.save_pretrained(tmp_path / "hf")
    write_family_gguf(tmp_path / "m.gguf", arch, model)

    hf, ours = load_model(tmp_path / "hf"), load_model(tmp_path / "m.gguf")
    # GGUF stores eps as float32; bos/eos come from the tokenizer metadata, which the HF config need not match
    assert ours.config.rms_norm_eps == pytest.approx(hf.config.rms_norm_eps)
    assert (ours.config.bos_token_id, ours.config.eos_token_ids) == (1, [2])
    assert dataclasses.replace(ours.config, rms_norm_eps=hf.config.rms_norm_eps, bos_token_id=hf.config.bos_token_id,
                               eos_token_ids=hf.config.eos_token_ids) == hf.config
    assert set(ours.weights) == set(hf.weights)
    for name, tensor in hf.weights.items():
        torch.testing.assert_close(ours.weights[name], tensor, rtol=0, atol=1e-6, msg=name)


def test_gguf_loading_matches_transformers(tmp_path):
    """transformers' GGUF reader maps names and undoes the Gemma norm offset on its own: it must agree."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    torch.manual_seed(0)
    model = FAMILIES["gemma2"]()
    write_family_gguf(tmp_path / "m.gguf", "gemma2", model)
    with torch.device("meta"):
        skeleton = tf.Gemma2ForCausalLM(model.config)
    reference = load_gguf_checkpoint(str(tmp_path / "m.gguf"), return_tensors=True, model_to_load=skeleton)["tensors"]
    ours = load_model(tmp_path / "m.gguf").weights
    assert set(ours) == set(reference) - {"lm_head.weight"}
    for name, tensor in ours.items():
        torch.testing.assert_close(tensor, reference[name].float(), rtol=0, atol=1e-6, msg=name)


def test_gguf_longrope_is_refused(tmp_path):
    torch.manual_seed(0)
    write_family_gguf(tmp_path / "m.gguf", "phi3", FAMILIES["phi3"](),
                      extra={"rope_factors_long.weight": torch.ones(TINY["head_dim"] // 2)})
    with pytest.raises(ValueError, match="LongRoPE"):
        load_model(tmp_path / "m.gguf")
