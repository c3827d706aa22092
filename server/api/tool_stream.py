"""The output side of tool calling: one choice's text -> OpenAI's content and tool-call deltas.

A `ToolCallStream` is fed the choice's text as the engine produces it and returns chat deltas:
`{"content": ...}` for text, and for each call first `{"tool_calls": [{"index", "id", "type", "function":
{"name", "arguments": ""}}]}`, then `{"tool_calls": [{"index", "function": {"arguments": piece}}]}`.
A non-streaming response feeds the whole text to the same stream and joins the deltas (`message`), so
streamed calls reassemble to exactly the non-streamed ones.

    named      every piece of text is a piece of the call's arguments (the grammar writes only them)
    required   the grammar writes compact `[{"name":"f","parameters":{...}},...]`: the name is sent once
               its string is complete, then the parameters' text as it comes, scanned for its end
    auto       text is sent as content until a start marker of the family's format (`tool_parsers`)
               appears; text that may be the start of a marker is held back. From the marker on, the
               text is held and parsed when the choice ends: calls if it parses, else it is sent as text.
"""

from __future__ import annotations

import re

from iterserve.server.api.tool_calls import ToolPlan, call_id
from iterserve.server.api.tool_parsers import Parser

# the head of one forced call: the grammar's property order and compact separators make it literal
_FORCED_HEAD = re.compile(r'\{"name":"([A-Za-z0-9_-]+)","parameters":')


class ToolCallStream:
    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.text = ""
        self.num_calls = 0
        self._at = 0  # text[:_at] is sent (auto) or scanned (required)
        self._calls_from: int | None = None  # auto: where the calls begin in text
        self._depth, self._in_string, self._escaped, self._in_args = 0, False, False, False

    def feed(self, text: str) -> list[dict]:
        self.text += text
        if self.plan.mode == "named":
            return self._named(text)
        if self.plan.mode == "required":
            return self._required()
        return self._auto(final=False)

    def finish(self) -> list[dict]:
        """The deltas the end of the choice releases (auto: the held text, as calls or as content)."""
        if self.plan.mode != "auto":
            return []
        return self._auto(final=True)

    @property
    def _parser(self) -> Parser:
        """auto mode's parser: plan_tools plans auto only for a family whose parser it knows."""
        assert self.plan.parser is not None
        return self.plan.parser

    def finish_reason(self, reason: str | None) -> str | None:
        # OpenAI: "tool_calls" when the model stopped after calling; a call cut by max_tokens stays "length"
        return "tool_calls" if self.num_calls and reason == "stop" else reason

    # -- the three modes -----------------------------------------------------------------------------

    def _header(self, name: str) -> dict:
        index, self.num_calls = self.num_calls, self.num_calls + 1
        return {"tool_calls": [{"index": index, "id": call_id(self.plan.parser), "type": "function",
                                "function": {"name": name, "arguments": ""}}]}

    def _arguments(self, piece: str) -> dict:
        return {"tool_calls": [{"index": self.num_calls - 1, "function": {"arguments": piece}}]}

    def _named(self, text: str) -> list[dict]:
        assert self.plan.function is not None  # named mode names its function
        deltas = [self._header(self.plan.function)] if not self.num_calls else []
        return deltas + ([self._arguments(text)] if text else [])

    def _required(self) -> list[dict]:
        deltas: list[dict] = []
        while True:
            if not self._in_args:
                head = _FORCED_HEAD.search(self.text, self._at)
                if head is None:
                    return deltas
                deltas.append(self._header(head.group(1)))
                self._at, self._in_args = head.end(), True
            start = self._at
            done = self._scan_value()
            if self._at > start:
                deltas.append(self._arguments(self.text[start:self._at]))
            if not done:
                return deltas
            self._in_args = False

    def _scan_value(self) -> bool:
        """Advance over the parameters' JSON text as far as it goes; True once the value is complete."""
        text = self.text
        while self._at < len(text):
            ch = text[self._at]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch in ",}]" and self._depth == 0:
                return True  # the end of a scalar value (not part of it)
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
            self._at += 1
            if self._depth == 0 and not self._in_string and ch in '}]"':
                return True
        return False

    def _auto(self, final: bool) -> list[dict]:
        parser = self._parser
        if self._calls_from is None:
            self._find_calls(final)
        if self._calls_from is None:  # all text: send what cannot be the start of a marker
            end = len(self.text) if final else len(self.text) - self._held_back()
            piece, self._at = self.text[self._at:end], max(self._at, end)
            return [{"content": piece}] if piece else []
        deltas: list[dict] = []
        if self._at < self._calls_from:
            deltas.append({"content": self.text[self._at:self._calls_from]})
            self._at = self._calls_from
        if not final:
            return deltas
        calls = parser.parse(self.text[self._calls_from:])
        if calls is None:  # a marker, then no well-formed call: the model's text, as text
            return deltas + [{"content": self.text[self._at:]}]
        for call in calls if self.plan.parallel else calls[:1]:
            deltas += [self._header(call.name), self._arguments(call.arguments)]
        return deltas

    def _find_calls(self, final: bool) -> None:
        parser = self._parser
        if parser.opens and not self.text[:self._at].strip():
            stripped = self.text.lstrip()
            if stripped.startswith(parser.opens):
                self._calls_from = len(self.text) - len(stripped)
                return
        found = [i for i in (self.text.find(m, max(0, self._at - len(m))) for m in parser.markers) if i >= 0]
        if found:
            self._calls_from = min(found)

    def _held_back(self) -> int:
        """How much of the text's end could still become a start marker (or opening JSON)."""
        parser = self._parser
        if parser.opens and not self.text.strip():
            return len(self.text) - self._at  # only whitespace so far: a call may still open
        for n in range(min(len(self.text), max(len(m) for m in parser.markers)), 0, -1):
            if any(m.startswith(self.text[-n:]) for m in parser.markers):
                return n
        return 0


def message(plan: ToolPlan, text: str, reason: str | None) -> tuple[dict, str | None]:
    """A whole choice's text -> its assistant message (with `tool_calls` when it called) and finish_reason."""
    stream = ToolCallStream(plan)
    deltas = stream.feed(text) + stream.finish()
    content = "".join(d.get("content", "") for d in deltas)
    calls: list[dict] = []
    for d in deltas:
        for part in d.get("tool_calls", ()):
            if "id" in part:
                calls.append({"id": part["id"], "type": "function",
                              "function": {"name": part["function"]["name"], "arguments": ""}})
            calls[part["index"]]["function"]["arguments"] += part["function"]["arguments"]
    msg: dict = {"role": "assistant", "content": content if content.strip() or not calls else None}
    if calls:
        msg["tool_calls"] = calls
    return msg, stream.finish_reason(reason)
