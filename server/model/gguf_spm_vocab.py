"""A SentencePiece-style GGUF vocabulary (`tokenizer.ggml.model == "llama"`: Llama 2, Mistral, Phi-3,
Gemma) as a `tokenizers` BPE model.

The file holds pieces, scores and token types but no merges. llama.cpp's SPM tokenizer, like
SentencePiece's BPE, repeatedly joins the adjacent pair whose joined piece is in the vocabulary with
the highest score; a BPE whose merges are ranked by that score does the same. Spaces become "▁" (with
one in front when `add_space_prefix`, llama.cpp's default), and what the vocabulary cannot spell falls
back to its byte tokens <0xNN>. Decoding undoes both.
"""

from __future__ import annotations

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, normalizers

from iterserve.server.model.gguf_loader import metadata

SPACE = "\u2581"  # SentencePiece's "▁"
_NORMAL, _UNKNOWN, _UNUSED = 1, 2, 5  # llama.cpp token types; control, user-defined and byte pieces never merge


def sentencepiece_backend(reader, tokens: list[str], path: str) -> BackendTokenizer:
    scores = metadata(reader, "tokenizer.ggml.scores")
    if not scores or len(scores) != len(tokens):
        raise ValueError(f"model: {path} has a SentencePiece vocabulary without one tokenizer.ggml.scores per token")
    types = metadata(reader, "tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    unk_id = metadata(reader, "tokenizer.ggml.unknown_token_id")
    if unk_id is None:
        unk_id = next((i for i, t in enumerate(types) if t == _UNKNOWN), None)
    backend = BackendTokenizer(models.BPE(
        vocab={token: i for i, token in enumerate(tokens)},
        merges=_merges(tokens, scores, types),
        unk_token=tokens[unk_id] if unk_id is not None else None,
        byte_fallback=True,
        fuse_unk=True,
    ))
    add_prefix = metadata(reader, "tokenizer.ggml.add_space_prefix", True)
    steps = [normalizers.Prepend(SPACE)] if add_prefix else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPACE)])
    backend.decoder = decoders.Sequence([
        decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
        *([decoders.Strip(" ", 1, 0)] if add_prefix else []),
    ])
    return backend


def _merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """Every split of a mergeable piece into two pieces of the vocabulary, best-scored piece first
    (ties by the parts' ids, so the order is deterministic)."""
    ids = {token: i for i, token in enumerate(tokens)}
    mergeable = {t for t, kind in zip(tokens, types, strict=True) if kind in (_NORMAL, _UNUSED)}
    ranked = []
    for token, score, kind in zip(tokens, scores, types, strict=True):
        if kind not in (_NORMAL, _UNUSED):
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in mergeable and right in mergeable:
                ranked.append((-score, ids[left], ids[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]
