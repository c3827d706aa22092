"""What a request's structured output asks for (a JSON schema, or any JSON object), and its validation.

The grammar engine is xgrammar (benchmarks/grammar_engines.py measured it against llguidance and
outlines-core). Only the engine core's process imports it (it brings torch and transformers: seconds of CPU
and hundreds of MB the API server does without): a `StructuredOutput` is data, and `check_schema`, which
builds a schema's grammar without the tokenizer (about half a millisecond), runs in the core before it
queues the request (the server's `AddChecked`, a 400 naming the field when it fails) or, offline, in
`LLMEngine.make_request`. The grammar text it builds is cached by the schema's text, so the compile against
the vocabulary (up to ~0.6 s, in grammar_manager.py, itself cached by that text) does not build it again.
Every grammar writes compact JSON: free whitespace would let a model pad an answer until max_tokens.

xgrammar 0.2.8's JSON-schema grammars let a string hold what JSON forbids in one: a length-bounded string
(maxLength / minLength) takes raw control characters, and every string takes UTF-16 surrogates (invalid
UTF-8). `grammar_text` rewrites those character classes in the grammar it makes, so output always parses.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass

from iterserve.server.errors import InvalidRequestError

SEPARATORS = (",", ":")
# the field the OpenAI API names in its errors; the offline API's field is SamplingParams.structured_output
SCHEMA_PARAM = "response_format.json_schema.schema"
_NATIVE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")
# what a JSON string may hold unescaped: not a quote, a backslash, a control character or a surrogate
_STRING_CHAR = r"[^\"\\\0-\x1f\ud800-\udfff]"
_LOOSE_STRING_CHARS = (r"[^\"\\\r\n]", r"[^\0-\x1f\"\\\r\n]")  # as xgrammar prints them
# checked grammars kept by their schema's text: an application sends the same few schemas again and again;
# a schema above the size bound is checked every time, so a 4-MiB body cannot pin hundreds of MB here
_CACHED_SCHEMAS = 256
_CACHED_SCHEMA_CHARS = 64 << 10

# OpenAI's json_object: any JSON object, written compact (xgrammar's built-in JSON grammar allows free
# whitespace, and its schema path puts ", " between the members of an open object whatever the separators)
JSON_OBJECT_EBNF = r"""
root ::= object
value ::= object | array | string | number | "true" | "false" | "null"
object ::= "{" (string ":" value ("," string ":" value)*)? "}"
array ::= "[" (value ("," value)*)? "]"
string ::= "\"" char* "\""
char ::= """ + _STRING_CHAR + r""" | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F])
number ::= "-"? ("0" | [1-9] [0-9]*) ("." [0-9]+)? ([eE] [+\-]? [0-9]+)?
"""


@dataclass
class StructuredOutput:
    """Exactly one of: `json_schema` (the schema as JSON text, which also keys the compiled-grammar cache)
    or `json_object` (any JSON object, OpenAI's `{"type": "json_object"}`). Making one checks only its shape:
    whether xgrammar takes the schema is `check_schema`'s question, asked in the engine core's process."""

    json_schema: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.json_schema, (dict, bool)):
            self.json_schema = json.dumps(self.json_schema)
        if (self.json_schema is None) == (not self.json_object):
            raise InvalidRequestError("structured_output", "give exactly one of json_schema and json_object")


def grammar_text(json_schema: str | None) -> str:
    """The grammar of a schema (None: json_object) in xgrammar's EBNF, which the core compiles."""
    if json_schema is None:
        return JSON_OBJECT_EBNF
    import xgrammar

    text = str(xgrammar.Grammar.from_json_schema(json_schema, any_whitespace=False, separators=SEPARATORS,
                                                 strict_mode=True))
    for loose in _LOOSE_STRING_CHARS:
        text = text.replace(loose, _STRING_CHAR)
    return text


def check_schema(schema: str, param: str = SCHEMA_PARAM) -> None:
    """Raise InvalidRequestError naming `param` (the request's field) when xgrammar cannot turn the schema
    into a grammar."""
    try:
        checked_grammar_text(schema)
    except Exception as e:  # noqa: BLE001 - the converter raises RuntimeError / InvalidJSONError with its reason
        raise InvalidRequestError(param, f"this JSON schema is not supported: {native_message(e)}") from None


def checked_grammar_text(json_schema: str | None) -> str:
    """`grammar_text`, parsed back as xgrammar's EBNF (what the compile will take), from the cache where
    the schema was checked before; raises xgrammar's error for a schema it cannot take."""
    if json_schema is not None and len(json_schema) > _CACHED_SCHEMA_CHARS:
        return _checked_grammar_text.__wrapped__(json_schema)
    return _checked_grammar_text(json_schema)


@functools.lru_cache(maxsize=_CACHED_SCHEMAS)  # thread-safe: the core's loop checks, its compile thread reads
def _checked_grammar_text(json_schema: str | None) -> str:
    import xgrammar

    text = grammar_text(json_schema)
    xgrammar.Grammar.from_ebnf(text)
    return text


def native_message(e: Exception) -> str:
    """xgrammar's C++ message without its timestamp and source location."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return _NATIVE_PREFIX.sub("", text)
