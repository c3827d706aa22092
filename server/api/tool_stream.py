"""The output side of tool calling: one choice's text -> OpenAI's content and tool-call deltas.

A `ToolCallStream` is fed the choice's text as the engine produces it and returns chat deltas:
`{"content": ...}` for text, and for each call first `{"tool_calls": [{"index", "id", "type", "function":
{"name", "arguments": ""}}]}`, then `{"tool_calls": [{"index", "function": {"arguments": piece}}]}`.
A non-streaming response feeds the whole text to the same stream and joins the deltas (`message`), so
streamed calls reassemble to exactly the non-streamed ones.

    named      every piece of text is a piece of the call's arguments (the grammar writes only them)
    required   the grammar writes compact `[{"name":"f","parameters":{...}},...]`: the name is sent once
               its string is complete, then the parameters' text as it comes, scanned for its end
    auto       content, and calls in the family's format read as they are written (`tool_auto`): a
               call's head once its name is complete, then its arguments as they come
"""

from __future__ import annotations

import re

from iterserve.server.api.tool_auto import AutoCalls
from iterserve.server.api.tool_calls import ToolPlan, call_id

# the head of one forced call: the grammar's property order and compact separators make it literal
_FORCED_HEAD = re.compile(r'\{"name":"([A-Za-z0-9_-]+)","parameters":')


class ToolCallStream:
    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.text = ""
        self.num_calls = 0
        self._at = 0  # required: text[:_at] is scanned
        # auto: plan_tools plans auto only for a family whose parser it knows
        self._auto = AutoCalls(plan.parser, plan.parallel) if plan.mode == "auto" and plan.parser else None
        self._depth, self._in_string, self._escaped, self._in_args = 0, False, False, False

    def feed(self, text: str) -> list[dict]:
        self.text += text
        if self.plan.mode == "named":
            return self._named(text)
        if self.plan.mode == "required":
            return self._required()
        return self._auto_deltas(text, final=False)

    def finish(self) -> list[dict]:
        """The deltas the end of the choice releases (auto: the held text, as calls or as content)."""
        return self._auto_deltas("", final=True) if self._auto is not None else []

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

    def _auto_deltas(self, text: str, final: bool) -> list[dict]:
        assert self._auto is not None
        deltas = []
        for kind, value in self._auto.feed(text, final):
            if kind == "content":
                deltas.append({"content": value})
            elif kind == "call":
                deltas.append(self._header(value))
            else:
                deltas.append(self._arguments(value))
        return deltas


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
