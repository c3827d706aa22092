"""`auto` tool calls read as they are written: one choice's text -> content, call heads and argument pieces.

`AutoCalls` is fed the text in pieces of any size and returns events: ("content", text), ("call", name),
("args", piece). Text is content until a start marker of the family's format (`tool_parsers`) appears
(text that may be the start of a marker is held back until it is not), or, for Llama 3's bare JSON and
Mistral's bare array, until the output opens with `{` / `[`. From there a reader for the format checks the
text character by character, as strict JSON:

    hermes       <tool_call> {call} </tool_call>   (the closing tag may be missing at the end of the output)
    llama3_json  [<|python_tag|>] {call} ; {call} ...
    mistral      [TOOL_CALLS] [{call}, {call}, ...]     or     [TOOL_CALLS]name[ARGS]{arguments}

A call's head is held until its name is complete and its arguments object opens (a call whose arguments
come before its name, are written as JSON text, or are missing is sent whole when its object closes);
then the arguments are sent as they come, each piece keeping them valid JSON so far. Where the text stops
being what the format allows (the marker was prose, the JSON breaks, the output ends inside a call), what
was not sent as a call is sent as content, with the rest of the choice. Text between and after calls is
content. Every decision depends only on the text before it, so however the text is cut the events join
to the same content and calls.
"""

from __future__ import annotations

import json
import re
from collections.abc import Generator

from iterserve.server.api.tool_parsers import Parser, call_of

_END = "\x00"  # what a reader gets when the output has ended (a NUL in the text reads as an end too)
_WS = " \t\r\n"
_ARGS_KEYS = {"hermes": ("arguments", "parameters"), "llama3_json": ("parameters", "arguments"),
              "mistral": ("arguments", "parameters")}
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_HEX = frozenset("0123456789abcdefABCDEF")
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")
_MAX_DEPTH = 64  # deeper arguments are refused (the JSON decoder's own limit is ~1000; no tool nests this deep)

Reader = Generator[None, str, None]  # fed one character at a time (`_END` at the end)


class _NotACall(Exception):
    """The text stopped being a call of the format."""


class AutoCalls:
    def __init__(self, parser: Parser, parallel: bool = True):
        self.parser = parser
        self.parallel = parallel  # False: calls after the first are read and dropped, as the request asked
        self.text = ""
        self.sent = 0  # text[:sent] is sent (as content or as a call) or read as the syntax of sent calls
        self.num_calls = 0
        self._fed = 0  # text[:_fed] went into the reader
        self._reader: Reader | None = None
        self._plain = False  # a call broke: the rest of the choice is content
        self._events: list[list[str]] = []
        self._back: tuple[str, int] | None = None  # a character a reader looked at and gave back
        self._at = 0  # the index of the character the reader got last

    def feed(self, piece: str, final: bool = False) -> list[tuple[str, str]]:
        self.text += piece
        while True:
            if self._reader is None and not self._text_mode(final):
                break
            if self._reader is not None and not self._run_reader(final):
                break
        events, self._events = [(kind, text) for kind, text in self._events if text or kind == "call"], []
        return events

    # -- text between calls ---------------------------------------------------------------------------

    def _text_mode(self, final: bool) -> bool:
        """Send content up to the next call; True when a call starts (its reader is set up)."""
        start = None if self._plain else self._call_start(final)
        if start is None:
            end = len(self.text) if final or self._plain else len(self.text) - self._held_back()
            self._content(end)
            return False
        self._content(start)
        marker = next((m for m in self.parser.markers if self.text.startswith(m, start)), "")
        self._fed = start + len(marker)  # bare JSON: the reader reads its opening `{` / `[` too
        self._reader = _READERS[self.parser.name](self)
        next(self._reader)
        return True

    def _call_start(self, final: bool) -> int | None:
        text, opens, markers = self.text, self.parser.opens, self.parser.markers
        if opens and not text[:self.sent].strip():
            stripped = text[self.sent:].lstrip()
            if stripped.startswith(opens):
                if not final and any(len(stripped) < len(m) and m.startswith(stripped) for m in markers):
                    return None  # "[TOOL" may be Mistral's marker or its bare array: wait
                return len(text) - len(stripped)
        found = [i for i in (text.find(m, self.sent) for m in markers) if i >= 0]
        return min(found) if found else None

    def _held_back(self) -> int:
        """How much of the text's end could still become a start marker (or the opening of bare JSON)."""
        text, opens = self.text, self.parser.opens
        if opens and not text.strip():
            return len(text) - self.sent  # only whitespace so far: a call may still open
        for n in range(min(len(text) - self.sent, max(len(m) for m in self.parser.markers)), 0, -1):
            if any(m.startswith(text[-n:]) for m in self.parser.markers):
                return n
        return 0

    def _content(self, end: int) -> None:
        if end > self.sent:
            self._emit("content", self.text[self.sent:end])
            self.sent = end

    def _emit(self, kind: str, text: str) -> None:
        if self._events and kind != "call" and self._events[-1][0] == kind:
            self._events[-1][1] += text  # one delta per kind and step, not one per character
        else:
            self._events.append([kind, text])

    # -- inside calls ---------------------------------------------------------------------------------

    def _run_reader(self, final: bool) -> bool:
        """Feed the reader what it has not seen; True when it is done (text mode resumes at `sent`)."""
        assert self._reader is not None
        try:
            while self._back is not None or self._fed < len(self.text) or final:
                if self._back is not None:
                    ch, self._at = self._back
                    self._back = None
                elif self._fed < len(self.text):
                    ch, self._at, self._fed = self.text[self._fed], self._fed, self._fed + 1
                else:
                    ch, self._at, final = _END, len(self.text), False
                self._reader.send(ch)
            return False
        except StopIteration:  # the calls are read; what follows is text again
            self._reader = None
            if self._back is not None:
                self._fed, self._back = self._back[1], None
            return True
        except _NotACall:
            self._reader, self._back, self._plain = None, None, True
            return True

    def _give_back(self, ch: str) -> None:
        self._back = (ch, self._at)

    def _args_upto(self, end: int) -> None:
        if end > self.sent:
            self._emit("args", self.text[self.sent:end])
            self.sent = end

    def _may_send(self) -> bool:
        return self.parallel or not self.num_calls

    def _call(self, name: str) -> None:
        self.num_calls += 1
        self._emit("call", name)

    def _object(self) -> Reader:
        """One call object, its `{` read: name and arguments, the arguments sent as they come."""
        start, keys = self._at, _ARGS_KEYS[self.parser.name]
        name, streamed, args_seen = None, False, False
        ch = yield from _skip(_WS)
        while ch != "}":
            if ch != '"':
                raise _NotACall
            key = yield from self._string(False)
            if (yield from _skip(_WS)) != ":":
                raise _NotACall
            ch = yield from _skip(_WS)
            if key == "name" and name is None:
                if ch != '"':
                    raise _NotACall
                name = yield from self._string(False)
                if not name:
                    raise _NotACall
            elif key in keys and not args_seen:
                args_seen = True
                if name is not None and ch == "{" and self._may_send():
                    streamed = True
                    self._call(name)
                    self.sent = self._at  # the head is sent: what was held up to the arguments is its syntax
                yield from self._value(ch, streamed, 0)
            else:
                yield from self._value(ch, False, 0)
            ch = yield from _skip(_WS)
            if ch == ",":
                ch = yield from _skip(_WS)
                if ch == "}":
                    raise _NotACall  # a trailing comma
            elif ch != "}":
                raise _NotACall
        if not streamed:  # held whole: the parser's own reading of the object decides
            call = call_of(_loads(self.text[start:self._at + 1]), keys)
            if call is None:
                raise _NotACall
            if self._may_send():
                self._call(call.name)
                self._emit("args", call.arguments)
        self.sent = self._at + 1

    def _value(self, ch: str, send: bool, depth: int) -> Reader:
        """One JSON value whose first character is `ch`, checked strictly; sent as arguments when `send`
        (after each character that keeps them valid JSON so far; a number once it has ended)."""
        if ch in "{[":
            if depth >= _MAX_DEPTH:
                raise _NotACall
            close = "}" if ch == "{" else "]"
            self._send_upto_here(send)
            ch = yield from _skip(_WS)
            while ch != close:
                if close == "}":
                    if ch != '"':
                        raise _NotACall
                    yield from self._string(send)
                    if (yield from _skip(_WS)) != ":":
                        raise _NotACall
                    self._send_upto_here(send)
                    ch = yield from _skip(_WS)
                yield from self._value(ch, send, depth + 1)
                ch = yield from _skip(_WS)
                if ch == close:
                    break
                if ch != ",":
                    raise _NotACall
                self._send_upto_here(send)
                ch = yield from _skip(_WS)
                if ch == close:
                    raise _NotACall  # a trailing comma
            self._send_upto_here(send)
        elif ch == '"':
            yield from self._string(send)
        elif ch in "-0123456789":
            start = self._at
            while ch in "-+.eE0123456789":
                ch = yield
            if not _NUMBER.fullmatch(self.text, start, self._at):
                raise _NotACall
            if send:
                self._args_upto(self._at)
            self._give_back(ch)  # the character after the number belongs to what follows it
        else:
            word = next((w for w in ("true", "false", "null") if w[0] == ch), None)
            if word is None:
                raise _NotACall
            yield from _literal(word[1:], (yield))
            self._send_upto_here(send)

    def _send_upto_here(self, send: bool) -> None:
        if send:
            self._args_upto(self._at + 1)

    def _string(self, send: bool) -> Generator[None, str, str]:
        """A JSON string, its `"` read -> its value."""
        start = self._at
        self._send_upto_here(send)
        while True:
            ch = yield
            if ch < " ":
                raise _NotACall  # the end, or a raw control character (JSON escapes them)
            if ch == '"':
                self._send_upto_here(send)
                value = json.loads(self.text[start:self._at + 1])
                assert isinstance(value, str)
                return value
            if ch == "\\":
                self._send_upto_here(send)
                ch = yield
                if ch == "u":
                    for _ in range(4):
                        self._send_upto_here(send)
                        ch = yield
                        if ch not in _HEX:
                            raise _NotACall
                elif ch not in '"\\/bfnrt':
                    raise _NotACall
            self._send_upto_here(send)


def _skip(chars: str) -> Generator[None, str, str]:
    """Read past `chars` -> the first other character (`_END` at the end)."""
    while True:
        ch = yield
        if ch not in chars:
            return ch


def _literal(word: str, ch: str) -> Reader:
    """`word`, its first character being `ch`."""
    for i, expected in enumerate(word):
        if i:
            ch = yield
        if ch != expected:
            raise _NotACall


def _loads(text: str):
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _hermes(calls: AutoCalls) -> Reader:
    if (yield from _skip(_WS)) != "{":
        raise _NotACall
    yield from calls._object()
    ch = yield from _skip(_WS)
    if ch == _END:
        return  # the closing tag may be left out at the end of the output (as the parser allows)
    yield from _literal("</tool_call>", ch)
    calls.sent = calls._at + 1


def _llama3_json(calls: AutoCalls) -> Reader:
    if (yield from _skip(_WS)) != "{":
        raise _NotACall
    while True:
        yield from calls._object()
        ch = yield from _skip(_WS + ";")  # Llama 3.2 separates parallel calls with "; "
        if ch != "{":
            calls._give_back(ch)  # not another call: text again (from the end of the last call)
            return


def _mistral(calls: AutoCalls) -> Reader:
    ch = yield from _skip(_WS)
    if ch == "[":  # [{call}, {call}, ...]
        ch = yield from _skip(_WS)
        while True:
            if ch != "{":
                raise _NotACall
            yield from calls._object()
            ch = yield from _skip(_WS)
            if ch == "]":
                calls.sent = calls._at + 1
                return
            if ch != ",":
                raise _NotACall
            ch = yield from _skip(_WS)
    start = calls._at  # name[ARGS]{...} of the newer tokenizers, each call after its own [TOOL_CALLS]
    while ch in _NAME_CHARS:
        ch = yield
    name = calls.text[start:calls._at]
    if ch in _WS:
        ch = yield from _skip(_WS)
    if not name:
        raise _NotACall
    yield from _literal("[ARGS]", ch)
    ch = yield from _skip(_WS)
    if ch != "{":
        raise _NotACall
    send = calls._may_send()
    if send:
        calls._call(name)
        calls.sent = calls._at
    yield from calls._value(ch, send, 0)
    calls.sent = calls._at + 1


_READERS = {"hermes": _hermes, "llama3_json": _llama3_json, "mistral": _mistral}
