"""Tool calls out of a model's text, in the formats of the families served (the model chose to call a tool).

    hermes       Hermes / Qwen2.5:  <tool_call>{"name": ..., "arguments": {...}}</tool_call>, one or several
    llama3_json  Llama 3.1 / 3.2:   {"name": ..., "parameters": {...}}, optionally after <|python_tag|>;
                                    several are separated by ";"
    mistral      Mistral:           [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]
                                    (or [TOOL_CALLS]name[ARGS]{...} of the newer tokenizers)

Each parser takes the whole text after its start marker and returns the calls, or None when that text is
not a well-formed call: the model's output is then answered as text, never as an error (a model may write
a marker and then ramble). The parser is chosen from the chat template's own markers (`detect_parser`), as
a template that renders tools also tells which format its model was trained to answer in.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

PARSERS = ("llama3_json", "hermes", "mistral")
PYTHON_TAG = "<|python_tag|>"
TOOL_CALLS_TAG = "[TOOL_CALLS]"
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_DECODER = json.JSONDecoder()


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text of the arguments object


@dataclass(frozen=True)
class Parser:
    name: str
    markers: tuple[str, ...]  # any of these in the output starts the calls
    # an output that opens with this is a call too: Llama 3's bare JSON, and Mistral's array once its
    # [TOOL_CALLS], a special token, is left out of the text (as special tokens are, by default)
    opens: str | None = None

    def parse(self, text: str) -> list[ParsedCall] | None:
        """`text` from the start marker (or the bare JSON) to the end of the output -> its calls."""
        return _PARSE[self.name](text)


def get_parser(name: str) -> Parser:
    if name == "hermes":
        return Parser("hermes", ("<tool_call>",))
    if name == "llama3_json":
        return Parser("llama3_json", (PYTHON_TAG,), opens="{")
    if name == "mistral":
        return Parser("mistral", (TOOL_CALLS_TAG,), opens="[")
    raise ValueError(f"tool call parser {name!r} is not one of {', '.join(PARSERS)}")


def detect_parser(chat_template: str | None) -> Parser | None:
    """The parser a chat template's markers name, or None (its model writes no tool calls we know)."""
    if not chat_template:
        return None
    if "<tool_call>" in chat_template:
        return get_parser("hermes")
    if TOOL_CALLS_TAG in chat_template:
        return get_parser("mistral")
    if PYTHON_TAG in chat_template or "ipython" in chat_template:
        return get_parser("llama3_json")
    return None


def call_of(obj, args_keys: tuple[str, ...]) -> ParsedCall | None:
    """A decoded call object -> the call (its arguments as JSON text), or None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    for key in args_keys:
        if key in obj:
            args = obj[key]
            if isinstance(args, str):  # some models write the arguments as JSON text
                args = _loads(args)
            return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False)) if isinstance(args, dict) else None
    return ParsedCall(obj["name"], "{}")  # a call without arguments


def _loads(text: str):
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than the decoder goes
        return None


def _all_or_none(calls: list[ParsedCall | None]) -> list[ParsedCall] | None:
    # one malformed call makes the whole output text: half of the calls would be a wrong answer
    present = [c for c in calls if c is not None]
    return present if calls and len(present) == len(calls) else None


def parse_hermes(text: str) -> list[ParsedCall] | None:
    bodies = _HERMES_CALL.findall(text)
    if _HERMES_CALL.sub("", text).strip():
        return None  # text between or after the calls: not a clean call sequence
    return _all_or_none([call_of(_loads(b), ("arguments", "parameters")) for b in bodies])


def parse_llama3_json(text: str) -> list[ParsedCall] | None:
    text = text.removeprefix(PYTHON_TAG).strip()
    calls, at = [], 0
    while at < len(text):
        try:
            obj, end = _DECODER.raw_decode(text, at)
        except (ValueError, RecursionError):
            return None
        calls.append(call_of(obj, ("parameters", "arguments")))
        at = end
        while at < len(text) and text[at] in " \t\r\n;":  # Llama 3.2 separates parallel calls with "; "
            at += 1
    return _all_or_none(calls)


def parse_mistral(text: str) -> list[ParsedCall] | None:
    text = text.removeprefix(TOOL_CALLS_TAG).strip()
    if text.startswith("["):
        calls = _loads(text)
        if not isinstance(calls, list):
            return None
        return _all_or_none([call_of(c, ("arguments", "parameters")) for c in calls])
    calls = []  # newer tokenizers: name[ARGS]{...} per call, each after its own [TOOL_CALLS]
    for part in text.split(TOOL_CALLS_TAG):
        name, sep, args = part.strip().partition("[ARGS]")
        if not sep:
            return None
        calls.append(call_of({"name": name.strip(), "arguments": _loads(args)}, ("arguments",)))
    return _all_or_none(calls)


_PARSE = {"hermes": parse_hermes, "llama3_json": parse_llama3_json, "mistral": parse_mistral}
