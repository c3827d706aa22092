"""Tokenizer, chat template and streaming detokenizer, built on the `tokenizers` library alone.

A Hugging Face directory brings its tokenizer.json. A GGUF brings only its vocabulary, so the tokenizer
is rebuilt here the way llama.cpp runs it: byte-level BPE from its merges, with the pre-tokenizer named
by `tokenizer.ggml.pre`, or a SentencePiece-style vocabulary from its scores (gguf_spm_vocab.py).
transformers is a test-only dependency and is not used at runtime.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from iterserve.server.model.gguf_loader import metadata, open_gguf
from iterserve.server.model.gguf_spm_vocab import sentencepiece_backend
from iterserve.server.model.loader import resolve_model_path

if TYPE_CHECKING:
    from iterserve.server.config import EngineConfig

# llama.cpp's pre-tokenizer regexes (llama-vocab.cpp), grouped the way it groups `tokenizer.ggml.pre`.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# ByteLevel's built-in regex is GPT-2's, which llama.cpp uses for these.
_GPT2_PRE = {"gpt-2", "mpt", "olmo", "jais"}
# GPT-2's regex after splitting every digit on its own (StarCoder's tokenizer, which SmolLM reuses).
_DIGITS_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_LLAMA3_PRE = {"llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx"}
_QWEN2_PRE = {"qwen2", "deepseek-r1-qwen", "stablelm2"}

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


class Tokenizer:
    def __init__(
        self,
        backend: BackendTokenizer,
        bos_token: str | None = None,
        eos_token: str | None = None,
        chat_template: str | None = None,
    ) -> None:
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token else None
        self.eos_token_id = backend.token_to_id(eos_token) if eos_token else None
        self._template: jinja2.Template | None = None

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # BOS/EOS, when the model wants them, are added by the backend's post-processor. The batch call
        # releases the GIL (`encode` holds it), so a long prompt tokenized in a server's worker thread
        # leaves the event loop running; it also skips the offsets, which nothing here uses.
        return self.backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render the model's jinja chat template the way transformers does. Template errors (including
        the template's own `raise_exception`, e.g. for a bad role order) become ValueError."""
        if self.chat_template is None:
            raise ValueError("chat template: this model has no chat template; send a plain prompt instead")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **kwargs,
            )
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template: {exc}") from exc

    def incremental_detokenizer(
        self, prompt_ids: list[int] | None = None, skip_special_tokens: bool = True
    ) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prompt_ids, skip_special_tokens)


class IncrementalDetokenizer:
    """Turns one request's generated token ids into text deltas as they arrive.

    Byte-level tokens can end inside a multi-byte UTF-8 character; `DecodeStream` holds such bytes back
    until the character is complete, so no delta ever carries a U+FFFD for a split character. The last
    few prompt ids give it context, so a first generated token that starts a word keeps its leading
    space under sentencepiece-style decoders.
    """

    _PROMPT_CONTEXT = 4

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None, skip_special_tokens: bool = True):
        self._backend = tokenizer.backend
        context = list(prompt_ids or [])[-self._PROMPT_CONTEXT:]
        self._stream = decoders.DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)

    def step(self, token_ids: int | list[int]) -> str:
        """Feed new ids; returns the text they complete ('' while a character is still partial)."""
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        if not ids:
            return ""
        return self._stream.step(self._backend, ids) or ""


def load_config_tokenizer(config: EngineConfig, resolved_path: str | None = None) -> Tokenizer | None:
    """The tokenizer of the model `config` names (`resolved_path`: where it was found, when known), without
    its weights or torch (the server's side loads it while the core loads the weights). A dummy model
    directory without tokenizer.json has none: requests then come as token ids."""
    if resolved_path is None:
        resolved_path = resolve_model_path(config.model)[1]
    if config.load_format == "dummy" and not os.path.isfile(os.path.join(resolved_path, "tokenizer.json")):
        return None
    return load_tokenizer(config.model)


def load_tokenizer(path: str | os.PathLike | None = None) -> Tokenizer | None:
    """The tokenizer for the model at `path` (same rules as `load_model`), or None for a Hugging Face
    directory without tokenizer.json."""
    kind, resolved = resolve_model_path(path)
    return _from_gguf(resolved) if kind == "gguf" else _from_hf_dir(resolved)


def _from_hf_dir(path: str) -> Tokenizer | None:
    tokenizer_file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tokenizer_file):
        return None
    try:
        backend = BackendTokenizer.from_file(tokenizer_file)
    except Exception as exc:
        raise ValueError(f"model: {tokenizer_file} could not be read: {exc}") from exc
    config = _read_json(os.path.join(path, "tokenizer_config.json")) or {}
    bos, eos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
    # An explicit add_bos_token/add_eos_token overrides the post-processor, as transformers' Llama and
    # GPT-2 tokenizers do when they load such a config.
    if "add_bos_token" in config or "add_eos_token" in config:
        _set_post_processor(backend, bos if config.get("add_bos_token") else None,
                            eos if config.get("add_eos_token") else None)
    return Tokenizer(backend, bos, eos, _hf_chat_template(path, config))


def _from_gguf(path: str) -> Tokenizer:
    reader = open_gguf(path)
    model = metadata(reader, "tokenizer.ggml.model")
    tokens = metadata(reader, "tokenizer.ggml.tokens")
    if model not in ("gpt2", "llama"):
        raise ValueError(f"model: tokenizer.ggml.model {model!r} in {path} is not supported; supported: "
                         "gpt2 (byte-level BPE), llama (SentencePiece)")
    if not tokens:
        raise ValueError(f"model: {path} lacks tokenizer.ggml.tokens")
    if model == "gpt2":
        backend = _byte_level_backend(reader, tokens, path)
    else:
        backend = sentencepiece_backend(reader, tokens, path)
    # Control tokens (<|im_start|>...) must match whole in text, not be split into bytes. A vocabulary
    # without token types has neither kind: the empty list ends the zip (strict=False).
    token_types = metadata(reader, "tokenizer.ggml.token_type") or []
    typed = list(zip(tokens, token_types, strict=False))
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in typed if k == _CONTROL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in typed if k == _USER_DEFINED])

    def token(key: str) -> str | None:
        index = metadata(reader, f"tokenizer.ggml.{key}")
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    bos, eos = token("bos_token_id"), token("eos_token_id")
    # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says not to
    _set_post_processor(
        backend,
        bos if metadata(reader, "tokenizer.ggml.add_bos_token", model == "llama") else None,
        eos if metadata(reader, "tokenizer.ggml.add_eos_token", False) else None,
    )
    return Tokenizer(backend, bos, eos, metadata(reader, "tokenizer.chat_template"))


def _byte_level_backend(reader, tokens: list[str], path: str) -> BackendTokenizer:
    merges = metadata(reader, "tokenizer.ggml.merges")
    if merges is None:
        raise ValueError(f"model: {path} lacks tokenizer.ggml.tokens/tokenizer.ggml.merges")
    # Older files have no `pre`; llama.cpp then falls back to GPT-2's split, and so does transformers.
    pre = metadata(reader, "tokenizer.ggml.pre", "gpt-2")
    backend = BackendTokenizer(models.BPE(
        vocab={token: i for i, token in enumerate(tokens)},
        merges=[tuple(m.split(" ", 1)) for m in merges],
        # llama.cpp takes a whole pre-token from the vocabulary before merging only for Llama-3 style files.
        ignore_merges=pre in _LLAMA3_PRE,
    ))
    backend.pre_tokenizer = _pre_tokenizer(pre, path)
    backend.decoder = decoders.ByteLevel()
    return backend


def _pre_tokenizer(pre: str, path: str) -> pre_tokenizers.PreTokenizer:
    if pre in _GPT2_PRE:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_PRE:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    split = _LLAMA3_SPLIT if pre in _LLAMA3_PRE else _QWEN2_SPLIT if pre in _QWEN2_PRE else None
    if split is None:
        supported = sorted(_GPT2_PRE | _DIGITS_PRE | _LLAMA3_PRE | _QWEN2_PRE)
        # Guessing would tokenize differently from how the model was trained, silently.
        raise ValueError(f"model: tokenizer.ggml.pre {pre!r} in {path} is not supported; "
                         f"supported: {', '.join(supported)}")
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def _set_post_processor(backend: BackendTokenizer, bos: str | None, eos: str | None) -> None:
    bos, eos = (t if t and backend.token_to_id(t) is not None else None for t in (bos, eos))
    single = " ".join(t for t in (bos and f"{bos}:0", "$A:0", eos and f"{eos}:0") if t)
    pair = " ".join(t for t in (single, bos and f"{bos}:1", "$B:1", eos and f"{eos}:1") if t)
    special = [(t, backend.token_to_id(t)) for t in {bos, eos} if t]
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def _hf_chat_template(path: str, config: dict[str, Any]) -> str | None:
    # transformers >= 4.43 saves the template to its own file; older configs embed it.
    jinja_file = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            return f.read()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _token_text(token: Any) -> str | None:
    # tokenizer_config.json writes special tokens either as strings or as serialized AddedToken dicts.
    if isinstance(token, dict):
        return token.get("content")
    return token if isinstance(token, str) else None


def _read_json(path: str) -> Any:
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"model: {path} could not be read: {exc}") from exc


def _compile_template(source: str) -> jinja2.Template:
    """Same environment as transformers' chat templates: sandboxed (templates come from model files),
    trim/lstrip blocks, loop controls, a non-HTML-escaping tojson, raise_exception and strftime_now."""

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise ValueError(f"chat template: could not be parsed: {exc}") from exc
