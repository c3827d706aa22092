"""A SentencePiece-style GGUF vocabulary (tokenizer.ggml.model "llama") tokenizes as SentencePiece does.

A real SentencePiece BPE model (byte fallback, Llama 2's settings) is trained on a small corpus, written
to GGUF as llama.cpp's convert_hf_to_gguf.py writes one (pieces, scores, token types, BOS/EOS ids), and
our tokenizer built from the file must encode every text as SentencePiece itself does and decode back.
"""

from __future__ import annotations

import io

import gguf
import pytest

from iterserve.server.model.tokenizer import load_tokenizer
from tests.test_tokenizer import TEXTS

spm = pytest.importorskip("sentencepiece")

CORPUS = [
    "The quick brown fox jumps over the lazy dog.", "Serving language models needs a paged KV cache.",
    "Continuous batching keeps the accelerator busy while requests come and go.",
    "def add(a, b):\n    return a + b", "the theme of the thesis is the theory of those themes",
    "Numbers like 3.14159 and 2024 appear too.", "café naïve résumé", "  spaces   and\ttabs\n\nnewlines",
] * 20
# llama.cpp token types, as the converter maps SentencePiece's piece kinds
_NORMAL, _UNKNOWN, _CONTROL, _UNUSED, _BYTE = 1, 2, 3, 5, 6


@pytest.fixture(scope="module", params=[True, False], ids=["space-prefix", "no-space-prefix"])
def spm_pair(request, tmp_path_factory):
    """(SentencePiece processor, our tokenizer from the GGUF written from it)."""
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS), model_writer=model, vocab_size=400, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, normalization_rule_name="identity",
        add_dummy_prefix=request.param, remove_extra_whitespaces=False, split_digits=True,
        bos_id=1, eos_id=2, unk_id=0, minloglevel=2,
    )
    processor = spm.SentencePieceProcessor(model_proto=model.getvalue())
    path = tmp_path_factory.mktemp("spm") / "tok.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    pieces = [processor.id_to_piece(i) for i in range(processor.get_piece_size())]
    writer.add_token_list(pieces)
    writer.add_token_scores([processor.get_score(i) for i in range(len(pieces))])
    writer.add_token_types([_UNKNOWN if processor.is_unknown(i) else _CONTROL if processor.is_control(i)
                            else _BYTE if processor.is_byte(i) else _UNUSED if processor.is_unused(i) else _NORMAL
                            for i in range(len(pieces))])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_space_prefix(request.param)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return processor, load_tokenizer(path)


@pytest.mark.parametrize("text", [t for t in TEXTS if "<|" not in t] + ["the theme of those theories", "x"])
def test_encode_matches_sentencepiece(spm_pair, text):
    processor, ours = spm_pair
    assert ours.encode(text) == [1, *processor.encode(text)]  # BOS added, as llama.cpp does by default
    assert ours.encode(text, add_special_tokens=False) == processor.encode(text)


@pytest.mark.parametrize("text", [t for t in TEXTS if "<|" not in t and t.strip()])
def test_decode_round_trips(spm_pair, text):
    processor, ours = spm_pair
    ids = ours.encode(text)
    assert ours.decode(ids) == processor.decode(ids[1:])
    stream = ours.incremental_detokenizer()
    assert "".join(stream.step(i) for i in ids) == processor.decode(ids[1:])
