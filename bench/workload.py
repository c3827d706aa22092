"""Workload shapes: which prompts to send and how many tokens to ask for, all drawn from one seed.

A shape is a pair of length distributions (prompt tokens, output tokens), or a mixture of such pairs
(`mixed`), or the lines of a JSONL file, or prompts sharing prefixes (`system-prompt`, `multi-turn`,
`shared-mix`: shared_prefix.py, with --prefix-len, --num-prefixes and --num-turns). Synthetic prompts
are lists of token ids drawn from a range that is printable ASCII in the common byte-level vocabularies
(SmolLM2, GPT-2, Llama 3, Qwen), so the prompt length is exact without a tokenizer; `words_prompt` builds
a text prompt of about the same number of tokens for servers (or the chat endpoint) that take text only,
exactly that number when a tokenizer is given (`--tokenizer`: a tokenizer.json or a model directory
holding one). Output lengths are enforced by sending `max_tokens` with `ignore_eos`.

Length specs on the command line: `128` or `fixed:128`, `uniform:32:256` (both ends included),
`lognormal:128:0.6` (median 128 tokens, sigma 0.6 of the underlying normal).
"""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from iterserve.bench.shared_prefix import SHARED_SHAPES, generate_shared

DEFAULT_TOKEN_RANGE = (32, 127)  # [lo, hi): ASCII punctuation and letters in byte-level vocabularies
WORDS = ("the of and to in is was for on that with as by at from his it an were are which this be or has had "
         "not but what all when we there can one your their said each she do how if will up other about out "
         "many then them these so some her would make like him into time look two more write go see number no "
         "way could people my than first water been call who oil its now find long down day did get come made "
         "may part").split()  # one token each (with the leading space) in common BPE vocabularies


class WorkloadError(ValueError):
    """A workload that cannot be built: the message names the option, or the file and line."""


@dataclass(frozen=True)
class LengthDist:
    kind: str  # fixed | uniform | lognormal
    a: float
    b: float = 0.0

    def __post_init__(self):
        if self.kind not in ("fixed", "uniform", "lognormal"):
            raise WorkloadError(f"unknown length distribution {self.kind!r} (fixed, uniform, lognormal)")
        if self.a < 1 or (self.kind == "uniform" and self.b < self.a) or (self.kind == "lognormal" and self.b < 0):
            raise WorkloadError(f"bad {self.kind} length parameters {self.a:g}, {self.b:g}")

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        return max(1, round(rng.lognormvariate(math.log(self.a), self.b)))

    def describe(self) -> str:
        if self.kind == "fixed":
            return f"fixed:{self.a:g}"
        return f"{self.kind}:{self.a:g}:{self.b:g}"


def parse_length(spec: str, option: str = "length") -> LengthDist:
    """`128`, `fixed:128`, `uniform:32:256`, `lognormal:128:0.6` -> LengthDist."""
    parts = spec.strip().split(":")
    try:
        if len(parts) == 1:
            return LengthDist("fixed", float(int(parts[0])))
        kind, *numbers = parts
        expected = 1 if kind == "fixed" else 2
        if len(numbers) != expected:
            raise ValueError
        return LengthDist(kind, *(float(n) for n in numbers))
    except (ValueError, TypeError):
        raise WorkloadError(f"{option}: cannot read {spec!r}; write 128, fixed:128, uniform:32:256 "
                            "or lognormal:MEDIAN:SIGMA") from None


@dataclass(frozen=True)
class RequestSpec:
    """One request to send: a prompt (token ids, text, or chat messages) and its output length."""

    index: int
    kind: str
    max_tokens: int
    prompt_ids: list[int] | None = None
    prompt_text: str | None = None
    messages: list[dict] | None = None
    input_len: int | None = None  # known for synthetic prompts

    def text(self) -> str:
        """The prompt as text (for servers or endpoints that take no token ids)."""
        if self.prompt_text is not None:
            return self.prompt_text
        if self.messages is not None:
            return "\n".join(str(m.get("content", "")) for m in self.messages)
        return words_prompt(self.input_len or len(self.prompt_ids or []), seed=self.index)


def words_prompt(num_words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(max(1, num_words)))


def load_tokenizer(path: str):
    """A `tokenizers.Tokenizer` from tokenizer.json or a directory holding one."""
    from tokenizers import Tokenizer

    file = Path(path) / "tokenizer.json" if Path(path).is_dir() else Path(path)
    try:
        return Tokenizer.from_file(str(file))
    except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exceptions
        raise WorkloadError(f"--tokenizer {path}: cannot load {file}: {e}") from None


def exact_text_prompt(tokenizer, num_tokens: int, seed: int) -> str:
    """Words cut to exactly `num_tokens` tokens of `tokenizer` (special tokens not counted)."""
    ids = tokenizer.encode(words_prompt(num_tokens + 8, seed), add_special_tokens=False).ids[:num_tokens]
    return tokenizer.decode(ids)


# (share, input, output) per class; shares of a shape sum to 1
PRESETS: dict[str, list[tuple[str, float, LengthDist, LengthDist]]] = {
    "random": [("random", 1.0, LengthDist("uniform", 64, 512), LengthDist("uniform", 16, 256))],
    "short-short": [("short-short", 1.0, LengthDist("fixed", 128), LengthDist("fixed", 32))],
    "short-long": [("short-long", 1.0, LengthDist("fixed", 128), LengthDist("fixed", 256))],
    "long-short": [("long-short", 1.0, LengthDist("fixed", 1024), LengthDist("fixed", 32))],
    "long-long": [("long-long", 1.0, LengthDist("fixed", 1024), LengthDist("fixed", 256))],
    # production-like: chat turns, long-context summaries / RAG, and long generations
    "mixed": [("chat", 0.5, LengthDist("lognormal", 200, 0.8), LengthDist("lognormal", 120, 0.7)),
              ("summarize", 0.3, LengthDist("lognormal", 900, 0.4), LengthDist("lognormal", 60, 0.6)),
              ("generate", 0.2, LengthDist("lognormal", 80, 0.6), LengthDist("lognormal", 400, 0.5))],
    # shared prefixes (shared_prefix.py): the input length is the question's, after the shared part
    "system-prompt": [("system-prompt", 1.0, LengthDist("uniform", 16, 64), LengthDist("fixed", 32))],
    "multi-turn": [("multi-turn", 1.0, LengthDist("uniform", 16, 64), LengthDist("fixed", 64))],
    "shared-mix": [("system-prompt", 0.4, LengthDist("uniform", 16, 64), LengthDist("fixed", 32)),
                   ("multi-turn", 0.4, LengthDist("uniform", 16, 64), LengthDist("fixed", 64)),
                   ("random", 0.2, LengthDist("uniform", 64, 512), LengthDist("uniform", 16, 256))],
    "jsonl": [],
}
SHAPES = tuple(PRESETS)
JSONL_DEFAULT_OUTPUT = LengthDist("fixed", 128)


@dataclass(frozen=True)
class WorkloadSpec:
    """What to send: a shape, optional overrides of its lengths, the seed, and limits from the server."""

    shape: str = "random"
    input_len: LengthDist | None = None  # overrides the shape's input distribution
    output_len: LengthDist | None = None  # overrides the shape's output distribution
    jsonl_path: str | None = None
    seed: int = 0
    token_range: tuple[int, int] = DEFAULT_TOKEN_RANGE
    max_model_len: int | None = None  # clip input + output to this (learnt from the server when not given)
    ignore_eos: bool = True
    tokenizer_path: str | None = None  # makes text prompts exact in length
    # shared-prefix shapes: tokens of each shared prefix (system prompt, conversation context), how many
    # distinct prefixes (system prompts, conversations under way at once), turns per conversation
    prefix_len: int = 1024
    num_prefixes: int = 4
    num_turns: int = 4
    jsonl_rows: list[dict] = field(default_factory=list, compare=False, repr=False)

    def __post_init__(self):
        if self.shape not in PRESETS:
            raise WorkloadError(f"--workload: unknown shape {self.shape!r}; choose from {', '.join(SHAPES)}")
        if self.shape == "jsonl" and not self.jsonl_path:
            raise WorkloadError("--workload jsonl needs --jsonl FILE")
        for name in ("prefix_len", "num_prefixes", "num_turns"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise WorkloadError(f"--{name.replace('_', '-')}: must be an integer >= 1, got {value!r}")
        lo, hi = self.token_range
        if not 0 <= lo < hi:
            raise WorkloadError(f"--prompt-token-range: need 0 <= LO < HI, got {lo}:{hi}")
        if self.tokenizer_path:
            load_tokenizer(self.tokenizer_path)  # a bad path fails now, not at the first request
        if self.shape == "jsonl" and not self.jsonl_rows:  # check the whole file before any request
            object.__setattr__(self, "jsonl_rows", load_jsonl(self.jsonl_path))

    def describe(self) -> dict:
        classes = [{"kind": k, "share": s, "input_len": (self.input_len or i).describe(),
                    "output_len": (self.output_len or o).describe()} for k, s, i, o in PRESETS[self.shape]]
        return {"shape": self.shape, "seed": self.seed, "classes": classes, "jsonl": self.jsonl_path,
                "token_range": list(self.token_range), "max_model_len": self.max_model_len,
                "ignore_eos": self.ignore_eos, "tokenizer": self.tokenizer_path,
                "output_len": self.output_len.describe() if self.output_len else None,
                **({"prefix_len": self.prefix_len, "num_prefixes": self.num_prefixes, "num_turns": self.num_turns}
                   if self.shape in SHARED_SHAPES else {})}


def load_jsonl(path: str) -> list[dict]:
    """Read and check every line before anything is sent; errors name the file and line."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise WorkloadError(f"--jsonl {path}: cannot read: {e}") from None
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path} line {number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise WorkloadError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(row, dict):
            raise WorkloadError(f"{where}: expected an object with \"prompt\" or \"messages\"")
        rows.append(_check_row(row, where))
    if not rows:
        raise WorkloadError(f"{path}: no prompts in the file")
    return rows


def _check_row(row: dict, where: str) -> dict:
    prompt, messages = row.get("prompt"), row.get("messages")
    if (prompt is None) == (messages is None):
        raise WorkloadError(f"{where}: give exactly one of \"prompt\" and \"messages\"")
    if prompt is not None and not (
            (isinstance(prompt, str) and prompt)
            or (isinstance(prompt, list) and prompt and all(type(t) is int and t >= 0 for t in prompt))):
        raise WorkloadError(f"{where}: \"prompt\" must be a non-empty string or a list of token ids")
    if messages is not None and not (isinstance(messages, list) and messages
                                     and all(isinstance(m, dict) and "role" in m for m in messages)):
        raise WorkloadError(f"{where}: \"messages\" must be a non-empty list of {{\"role\", \"content\"}}")
    max_tokens = row.get("max_tokens", row.get("output_len"))
    if max_tokens is not None and not (type(max_tokens) is int and max_tokens >= 1):
        raise WorkloadError(f"{where}: \"max_tokens\" must be an integer >= 1")
    return {"prompt": prompt, "messages": messages, "max_tokens": max_tokens}


def _clip(input_len: int, output_len: int, max_model_len: int | None) -> tuple[int, int]:
    input_len, output_len = max(1, input_len), max(1, output_len)
    if max_model_len is not None and input_len + output_len > max_model_len:
        output_len = min(output_len, max(1, max_model_len // 2))
        input_len = max(1, min(input_len, max_model_len - output_len))
    return input_len, output_len


def generate_requests(spec: WorkloadSpec, num_requests: int | None) -> Iterator[RequestSpec]:
    """The seeded sequence of requests (endless when num_requests is None; a JSONL file repeats)."""
    rng = random.Random(spec.seed)
    counter = itertools.count() if num_requests is None else iter(range(num_requests))
    if spec.shape == "jsonl":
        rows = spec.jsonl_rows
        output = spec.output_len or JSONL_DEFAULT_OUTPUT
        for i in counter:
            row = rows[i % len(rows)]
            max_tokens = row["max_tokens"] or output.sample(rng)
            prompt = row["prompt"]
            yield RequestSpec(index=i, kind="jsonl", max_tokens=max_tokens,
                              prompt_ids=prompt if isinstance(prompt, list) else None,
                              prompt_text=prompt if isinstance(prompt, str) else None,
                              messages=row["messages"],
                              input_len=len(prompt) if isinstance(prompt, list) else None)
        return
    classes = PRESETS[spec.shape]
    weights = [share for _, share, _, _ in classes]
    lo, hi = spec.token_range
    tokenizer = load_tokenizer(spec.tokenizer_path) if spec.tokenizer_path else None
    if spec.shape in SHARED_SHAPES:
        yield from generate_shared(spec, classes, counter, rng, tokenizer)
        return
    for i in counter:
        kind, _, input_dist, output_dist = classes[0] if len(classes) == 1 else rng.choices(classes, weights)[0]
        input_len, output_len = _clip((spec.input_len or input_dist).sample(rng),
                                      (spec.output_len or output_dist).sample(rng), spec.max_model_len)
        ids = [rng.randrange(lo, hi) for _ in range(input_len)]
        text = exact_text_prompt(tokenizer, input_len, seed=spec.seed * 1_000_003 + i) if tokenizer else None
        yield RequestSpec(index=i, kind=kind, max_tokens=output_len, prompt_ids=ids, prompt_text=text,
                          input_len=input_len)
