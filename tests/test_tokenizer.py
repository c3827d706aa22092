"""Tokenizer built from GGUF metadata / tokenizer.json, checked against transformers (test-only)."""

from __future__ import annotations

import json
import os
import shutil

import gguf
import pytest
from transformers import AutoTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

from iterserve.server.model.loader import default_model_path
from iterserve.server.model.tokenizer import Tokenizer, load_tokenizer

TEXTS = [
    "Hello, world! How are you today?",
    "def add(a, b):\n    return a + b  # sum\n\n\tprint(add(1, 2))",
    "12345",
    "Pi is 3.14159 and 2024-06-01 is a date; 1,000,000 people.",
    "Emoji: 😀 🦙 ❤️ 👨\u200d👩\u200d👧 🇫🇷",
    "Accents: café, naïve, résumé, Ångström, São Paulo, Đặng",
    "中文：你好，世界！机器学习很有趣。",
    "  leading, trailing and   multiple   spaces  \n\n",
    "don't won't I'll we've THEY'RE",
    "<|im_start|>user\nhi there<|im_end|>\n",
    "",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi 👋"}],
    [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
    ],
]


@pytest.fixture(scope="module")
def ours() -> Tokenizer:
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def reference():
    folder, name = os.path.split(default_model_path())
    return AutoTokenizer.from_pretrained(folder, gguf_file=name)


@pytest.fixture(scope="module")
def hf_dir(reference, tmp_path_factory):
    """The default model's tokenizer as a Hugging Face directory, written by transformers."""
    path = tmp_path_factory.mktemp("hf_tokenizer")
    reference.save_pretrained(path)
    (path / "config.json").write_text("{}")  # marks it as an HF model directory
    return path


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(ours, reference, text):
    assert ours.encode(text) == reference.encode(text)
    assert ours.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False)
    assert ours.decode(ours.encode(text), skip_special_tokens=False) == text


def test_special_tokens(ours):
    assert (ours.bos_token_id, ours.eos_token_id, ours.vocab_size) == (1, 2, 49152)
    # Control tokens match whole; SmolLM2 sets add_bos_token false, so nothing is prepended.
    assert ours.encode("<|im_start|>user<|im_end|>") == [1, *ours.encode("user"), 2]
    assert ours.decode([1, *ours.encode("hi"), 2]) == "hi"
    assert ours.decode([1, 2], skip_special_tokens=False) == "<|im_start|><|im_end|>"


def test_numerals_split_one_per_pre_token(ours):
    """tokenizer.ggml.pre "smollm" is llama.cpp's StarCoder rule: every \\p{N} character is its own
    pre-token before GPT-2's split, as in SmolLM2's tokenizer.json (Digits(individual_digits=True)).
    transformers' GGUF conversion ignores "smollm" and keeps plain GPT-2, so it differs from both on
    non-ASCII numerals such as " ²" (the vocabulary has no merged ASCII digits, so those agree)."""
    pieces = [p for p, _ in ours.backend.pre_tokenizer.pre_tokenize_str("x 12 ² ½")]
    assert pieces == ["x", "Ġ", "1", "2", "Ġ", "Â²", "Ġ", "Â½"]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(ours, reference, messages, add_generation_prompt):
    expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenization(ours, text):
    ids = ours.encode(text)
    detok = ours.incremental_detokenizer()
    deltas = [detok.step(i) for i in ids]
    assert "".join(deltas) == ours.decode(ids)
    assert not any("\ufffd" in d for d in deltas)


def test_incremental_detokenization_holds_back_split_characters(ours):
    ids = ours.encode("🦙")
    assert len(ids) > 1  # one character spread over several byte-level tokens
    detok = ours.incremental_detokenizer()
    assert [detok.step(i) for i in ids] == [""] * (len(ids) - 1) + ["🦙"]
    # Prompt context and batched steps give the same text.
    prompt, generated = ours.encode("Say hi: "), ours.encode("Hello there, 世界")
    detok = ours.incremental_detokenizer(prompt_ids=prompt)
    assert detok.step(generated[:3]) + detok.step(generated[3:]) + detok.step([]) == "Hello there, 世界"


def test_hf_directory_tokenizer(hf_dir, reference):
    tok = load_tokenizer(hf_dir)
    assert (tok.bos_token_id, tok.eos_token_id, tok.vocab_size) == (1, 2, 49152)
    for text in TEXTS:
        assert tok.encode(text) == reference.encode(text)
    for messages in CONVERSATIONS:
        assert tok.apply_chat_template(messages) == reference.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True)


def test_hf_directory_add_bos_and_no_template(hf_dir, tmp_path):
    shutil.copytree(hf_dir, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": True}))
    os.remove(tmp_path / "chat_template.jinja")
    tok = load_tokenizer(tmp_path)
    assert tok.encode("hi") == [1, *tok.encode("hi", add_special_tokens=False)]
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_hf_directory_without_tokenizer(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert load_tokenizer(tmp_path) is None


def test_template_environment(ours):
    template = (
        "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('bad role: ' + m.role) }}{% endif %}"
        "{% if loop.index > 1 %}{% break %}{% endif %}{{ bos_token }}{{ m | tojson }}{{ eos_token }}\n"
        "{% endfor %}"
    )
    tok = Tokenizer(ours.backend, "<|im_start|>", "<|im_end|>", template)
    # Like transformers: trim_blocks, loop controls, and a tojson that keeps "<" and non-ASCII as is.
    out = tok.apply_chat_template([{"role": "user", "content": "<b>é"}, {"role": "user", "content": "x"}])
    assert out == '<|im_start|>{"role": "user", "content": "<b>é"}<|im_end|>\n'
    with pytest.raises(ValueError, match="chat template: bad role: tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    with pytest.raises(ValueError, match="chat template: could not be parsed"):
        Tokenizer(ours.backend, chat_template="{% for %}").apply_chat_template([])
    with pytest.raises(ValueError, match="chat template: .*unsafe"):
        Tokenizer(ours.backend, chat_template="{{ messages.__class__.__mro__ }}").apply_chat_template([])


# ---------------------------------------------------------------- other GGUF tokenizers

BYTES = list(bytes_to_unicode().values())
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "1 2", "12 3"]
WORDS = ["Ġt", "he", "Ġthe", "in", "12", "123"]


def write_tokenizer_gguf(path, pre: str, model: str = "gpt2", add_bos: bool = False) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    tokens = ["<s>", "</s>", *BYTES, *WORDS]
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_merges(MERGES)
    writer.add_token_types([3, 3] + [1] * (len(tokens) - 2))
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_add_bos_token(add_bos)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "gpt-2"])
def test_other_pre_tokenizers_match_transformers(tmp_path, pre):
    write_tokenizer_gguf(tmp_path / "tok.gguf", pre, add_bos=True)
    tok = load_tokenizer(tmp_path / "tok.gguf")
    reference = AutoTokenizer.from_pretrained(tmp_path, gguf_file="tok.gguf")
    for text in ["the thin 12345 then\n\n  in", "don't 1234567 ünï", "<s>the</s>"]:
        assert tok.encode(text) == reference.encode(text), text
    assert tok.encode("the")[0] == tok.bos_token_id == 0 and tok.eos_token_id == 1


def test_unsupported_gguf_tokenizers(tmp_path):
    write_tokenizer_gguf(tmp_path / "pre.gguf", "mystery-pre")
    with pytest.raises(ValueError, match="tokenizer.ggml.pre 'mystery-pre'.*supported: .*smollm"):
        load_tokenizer(tmp_path / "pre.gguf")
    write_tokenizer_gguf(tmp_path / "t5.gguf", "default", model="t5")
    with pytest.raises(ValueError, match="tokenizer.ggml.model 't5'.*not supported.*llama \\(SentencePiece\\)"):
        load_tokenizer(tmp_path / "t5.gguf")
    # SentencePiece vocabularies (tests/test_gguf_spm_tokenizer.py) need their scores
    write_tokenizer_gguf(tmp_path / "spm.gguf", "default", model="llama")
    with pytest.raises(ValueError, match="tokenizer.ggml.scores"):
        load_tokenizer(tmp_path / "spm.gguf")
