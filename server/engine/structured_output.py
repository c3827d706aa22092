"""What a request's structured output asks for (a JSON schema, or any JSON object), and its validation.

The grammar engine is xgrammar (benchmarks/grammar_engines.py measured it against llguidance and
outlines-core): checking a schema builds its grammar without the tokenizer, well under a millisecond,
so it runs wherever SamplingParams are made (the API process, before anything reaches the engine);
compiling it against the vocabulary (up to ~0.6 s) happens in the engine core (grammar_manager.py).
Every grammar writes compact JSON: free whitespace would let a model pad an answer until max_tokens.

xgrammar 0.2.8's JSON-schema grammars let a string hold what JSON forbids in one: a length-bounded string
(maxLength / minLength) takes raw control characters, and every string takes UTF-16 surrogates (invalid
UTF-8). `grammar_text` rewrites those character classes in the grammar it makes, so output always parses.
"""

from __future__ import annotations

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
    or `json_object` (any JSON object, OpenAI's `{"type": "json_object"}`)."""

    json_schema: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.json_schema, (dict, bool)):
            self.json_schema = json.dumps(self.json_schema)
        if (self.json_schema is None) == (not self.json_object):
            raise InvalidRequestError("structured_output", "give exactly one of json_schema and json_object")
        if self.json_schema is not None:
            check_schema(self.json_schema)



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


def check_schema(schema: str) -> None:
    """Raise InvalidRequestError naming the schema when xgrammar cannot turn it into a grammar."""
    import xgrammar

    try:
        xgrammar.Grammar.from_ebnf(grammar_text(schema))
    except Exception as e:  # noqa: BLE001 - the converter raises RuntimeError / InvalidJSONError with its reason
        raise InvalidRequestError(SCHEMA_PARAM, f"this JSON schema is not supported: {native_message(e)}") from None


def native_message(e: Exception) -> str:
    """xgrammar's C++ message without its timestamp and source location."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return _NATIVE_PREFIX.sub("", text)
