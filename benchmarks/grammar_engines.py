"""Per-token cost of the three grammar engines on PyPI, side by side: xgrammar, llguidance, outlines-core.

    python benchmarks/grammar_engines.py [--batch 64] [--model ~/.cache/iterserve/smollm2-135m-instruct-hf]

For each engine, on the bundled model's tokenizer (byte-level BPE, vocab 49152), CPU, printed per schema:
  compile   time to compile the schema (first time; what a request pays on a cache miss)
  fill      time per step to fill the token bitmask of `--batch` sequences (the engine's own batch API
            where it has one, with its default threads, and a plain loop over matchers): the mean over the
            document's tokens, which is what throughput pays (a median hides the costly states, such as
            inside a length-bounded string), and the worst step
  advance   time per step to advance every sequence's matcher by one token
The sequences walk real token paths: a valid JSON document per schema, tokenized by the model's tokenizer.
`json_object` (any JSON value, OpenAI's `{"type": "json_object"}`) needs a recursive grammar: outlines-core
compiles regular expressions only, so it has no row there.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer

SCHEMAS = {
    "person": ({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.[a-z]{2,3}$"},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 5},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    }, {"name": "Augusta Ada King, Countess of Lovelace", "age": 36, "email": "ada@math.org",
        "tags": ["math", "poetry", "engines"]}),
    "tool_call": ({
        "type": "object",
        "properties": {
            "name": {"enum": ["get_weather", "search_web", "send_email"]},
            "arguments": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 14},
                },
                "required": ["city"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }, {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius", "days": 3}}),
    "todo_list": ({
        "type": "object",
        "properties": {
            "items": {"type": "array", "maxItems": 8, "items": {
                "type": "object",
                "properties": {"id": {"type": "integer"}, "title": {"type": "string", "maxLength": 60},
                               "done": {"type": "boolean"}, "due": {"type": ["string", "null"]}},
                "required": ["id", "title", "done"],
                "additionalProperties": False,
            }},
            "total": {"type": "number"},
        },
        "required": ["items", "total"],
        "additionalProperties": False,
    }, {"items": [{"id": 1, "title": "Buy milk", "done": False, "due": None},
                  {"id": 2, "title": "Write the quarterly report for the board", "done": True, "due": "2026-01-02"},
                  {"id": 3, "title": "Call the plumber", "done": False}], "total": 3.0}),
    "notes": ({  # benchmarks/structured_output.py's: most steps inside a length-bounded string
        "type": "object",
        "properties": {"notes": {"type": "array", "minItems": 3, "maxItems": 3,
                                 "items": {"type": "string", "minLength": 20, "maxLength": 40}}},
        "required": ["notes"], "additionalProperties": False,
    }, {"notes": ["The capital of France is Paris.", "Water boils at 100 degrees.", "Cats sleep most of the day."]}),
    "json_object": (None, {"answer": "The capital of France is Paris.", "confidence": 0.97,
                           "sources": [{"title": "Atlas", "page": 12}], "verified": True}),
}


# every engine writes compact JSON (no free whitespace): a small model given free whitespace can pad forever
COMPACT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


# -- the engines: each gives (compile(schema_text | None) -> grammar, new_matcher(grammar), fill, advance)

class XGrammar:
    name = "xgrammar"

    def __init__(self, vocab: list[bytes], vocab_size: int, eos: int):
        import xgrammar as xgr
        self.xgr = xgr
        info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=[eos])
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        self.batch = xgr.BatchGrammarMatcher()

    def compile(self, schema: str | None):
        if schema is None:
            # its schema path writes ", " between the members of an open object whatever the separators: its
            # built-in JSON grammar (what vLLM uses for json_object) accepts compact JSON
            return self.compiler.compile_builtin_json_grammar()
        return self.compiler.compile_json_schema(schema, any_whitespace=False, separators=(",", ":"))

    def matcher(self, grammar):
        return self.xgr.GrammarMatcher(grammar)

    def fill_batch(self, matchers, bitmask):
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def fill_loop(self, matchers, bitmask):
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, i)

    def advance(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer_json: str, vocab_size: int, eos: int):
        import llguidance
        import llguidance.torch as llt
        self.llg, self.llt = llguidance, llt
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos)
        self.executor = llguidance.LLExecutor()

    def compile(self, schema: str | None):
        text = schema if schema is not None else json.dumps({"type": "object"})
        grammar = self.llg.LLMatcher.grammar_from_json_schema(text, defaults=COMPACT)
        # llguidance compiles lazily: building the matcher is where the grammar is compiled
        self.llg.LLMatcher(self.tokenizer, grammar)
        return grammar

    def matcher(self, grammar):
        return self.llg.LLMatcher(self.tokenizer, grammar)

    def fill_batch(self, matchers, bitmask):
        self.llt.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def fill_loop(self, matchers, bitmask):
        for i, m in enumerate(matchers):
            self.llt.fill_next_token_bitmask(m, bitmask, i)

    def advance(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, vocab: list[bytes], vocab_size: int, eos: int):
        import outlines_core
        self.oc = outlines_core
        tokens: dict[bytes, list[int]] = {}
        for i, b in enumerate(vocab):
            if i != eos and b:
                tokens.setdefault(b, []).append(i)
        self.vocabulary = outlines_core.Vocabulary(eos, tokens)
        self.vocab_size = vocab_size

    def compile(self, schema: str | None):
        if schema is None:
            raise NotImplementedError("regular expressions only: no recursive JSON")
        regex = self.oc.json_schema.build_regex_from_schema(schema, whitespace_pattern="")
        return self.oc.Index(regex, self.vocabulary)

    def matcher(self, index):
        return self.oc.Guide(index)

    def fill_batch(self, matchers, bitmask):
        self.fill_loop(matchers, bitmask)

    def fill_loop(self, matchers, bitmask):
        for i, g in enumerate(matchers):
            row = bitmask[i]
            g.write_mask_into(row.data_ptr(), row.numel(), row.element_size())

    def advance(self, guide, token: int) -> bool:
        if token == self.vocabulary.get_eos_token_id():
            return guide.is_finished()  # a Guide has no state after EOS: advancing on it raises
        guide.advance(token)
        return True


def byte_vocab(tok: Tokenizer) -> list[bytes]:
    """Token id -> the bytes it stands for (GPT-2 byte-level alphabet undone; special tokens kept as text)."""
    alphabet = _bytes_to_unicode()
    decoder = {c: b for b, c in alphabet.items()}
    vocab = [b""] * tok.get_vocab_size()
    specials = {t.content for t in tok.get_added_tokens_decoder().values()}
    for text, i in tok.get_vocab().items():
        vocab[i] = text.encode() if text in specials else bytes(decoder[c] for c in text)
    return vocab


def _bytes_to_unicode() -> dict[int, str]:
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, n = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, map(chr, chars), strict=True))


def measure(engine, schema_name: str, schema, doc, tok: Tokenizer, batch: int, eos: int, vocab_size: int) -> dict:
    text = None if schema is None else json.dumps(schema)
    t0 = time.perf_counter()
    try:
        grammar = engine.compile(text)
    except NotImplementedError as e:
        return {"engine": engine.name, "schema": schema_name, "error": str(e)}
    compile_ms = (time.perf_counter() - t0) * 1e3
    path = tok.encode(json.dumps(doc, separators=(",", ":")), add_special_tokens=False).ids + [eos]
    bitmask = torch.zeros((batch, (vocab_size + 31) // 32), dtype=torch.int32)
    results = {}
    for mode in ("batch", "loop"):
        matchers = [engine.matcher(grammar) for _ in range(batch)]
        fill_s, adv_s = [], []
        for step, token in enumerate(path):
            t0 = time.perf_counter()
            (engine.fill_batch if mode == "batch" else engine.fill_loop)(matchers, bitmask)
            t1 = time.perf_counter()
            if not (bitmask[0, token // 32] >> (token % 32)) & 1:
                raise AssertionError(f"{engine.name}/{schema_name}: token {token} at step {step} masked off")
            for m in matchers:
                engine.advance(m, token)
            t2 = time.perf_counter()
            fill_s.append(t1 - t0)
            adv_s.append(t2 - t1)
        results[mode] = (statistics.mean(fill_s) * 1e3, statistics.mean(adv_s) * 1e3, max(fill_s) * 1e3)
    return {"engine": engine.name, "schema": schema_name, "compile_ms": compile_ms, "steps": len(path),
            "fill_batch_ms": results["batch"][0], "fill_loop_ms": results["loop"][0],
            "fill_max_ms": min(results["batch"][2], results["loop"][2]), "advance_ms": results["batch"][1]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.path.expanduser("~/.cache/iterserve/smollm2-135m-instruct-hf"))
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()
    tokenizer_json = str(Path(args.model) / "tokenizer.json")
    tok = Tokenizer.from_file(tokenizer_json)
    vocab_size = tok.get_vocab_size()
    eos = tok.token_to_id("<|im_end|>")
    vocab = byte_vocab(tok)
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch threads "
          f"{torch.get_num_threads()}, vocab {vocab_size}, batch {args.batch}, "
          f"{time.strftime('%Y-%m-%d')}; means per step over the document's tokens (fill max: the worst step), ms")
    engines = []
    for make in (lambda: XGrammar(vocab, vocab_size, eos), lambda: LLGuidance(tokenizer_json, vocab_size, eos),
                 lambda: OutlinesCore(vocab, vocab_size, eos)):
        t0 = time.perf_counter()
        engine = make()
        print(f"# {engine.name}: tokenizer set-up {(time.perf_counter() - t0) * 1e3:.0f} ms")
        engines.append(engine)
    rows = [measure(e, name, schema, doc, tok, args.batch, eos, vocab_size)
            for name, (schema, doc) in SCHEMAS.items() for e in engines]
    print(f"{'schema':<12} {'engine':<14} {'compile ms':>11} {'fill batch':>11} {'fill loop':>10} {'fill max':>9} "
          f"{'advance':>8} {'steps':>6}")
    for r in rows:
        if "error" in r:
            print(f"{r['schema']:<12} {r['engine']:<14} {'n/a: ' + r['error']}")
            continue
        print(f"{r['schema']:<12} {r['engine']:<14} {r['compile_ms']:>11.1f} {r['fill_batch_ms']:>11.3f} "
              f"{r['fill_loop_ms']:>10.3f} {r['fill_max_ms']:>9.3f} {r['advance_ms']:>8.3f} {r['steps']:>6}")


if __name__ == "__main__":
    main()
