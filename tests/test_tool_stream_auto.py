"""`auto` tool calls streamed as the model writes them (`tool_auto` through `ToolCallStream`), per family:
the head once the name is complete, then argument pieces; what is not a call is content. Hypothesis
renders calls in each format (with prose, odd whitespace, cuts and stray characters): however the text is
cut, the deltas join to the non-streamed message, and a well-formed text gives the parser's own calls."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from iterserve.server.api.tool_calls import ToolPlan
from iterserve.server.api.tool_parsers import PYTHON_TAG, get_parser
from iterserve.server.api.tool_stream import ToolCallStream, message


def reassemble(deltas: list[dict]) -> tuple[str, list[dict]]:
    """Deltas -> (content, calls) as a client joins them, checking OpenAI's chunk shape on the way."""
    content, calls = "", {}
    for d in deltas:
        content += d.get("content", "")
        for part in d.get("tool_calls", ()):
            if part["index"] not in calls:  # the first delta of a call names it, with its id and type
                assert part["id"] and part["type"] == "function" and part["function"]["arguments"] == ""
                assert part["index"] == len(calls)
                calls[part["index"]] = {"name": part["function"]["name"], "arguments": ""}
            else:
                assert "name" not in part["function"] and "id" not in part
            calls[part["index"]]["arguments"] += part["function"]["arguments"]
    return content, [calls[i] for i in sorted(calls)]


def streamed(plan: ToolPlan, pieces: list[str]) -> tuple[list[dict], ToolCallStream]:
    stream = ToolCallStream(plan)
    deltas = [d for piece in pieces for d in stream.feed(piece)]
    return deltas + stream.finish(), stream


def auto(parser: str, parallel: bool = True) -> ToolPlan:
    return ToolPlan("auto", parser=get_parser(parser), parallel=parallel)


def by_char(parser: str, text: str) -> list[list[dict]]:
    """The deltas each character of `text` releases (the last entry: what the end of the choice does)."""
    stream = ToolCallStream(auto(parser))
    return [stream.feed(ch) for ch in text] + [stream.finish()]


FORMATS = [
    ("hermes", 'On it.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n'
               '</tool_call>', "On it.\n"),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "days": [1, 2]}}', ""),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": [1, 2]}}', ""),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}]', ""),
    ("mistral", '[{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}]', ""),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": [1, 2]}', ""),
]


@pytest.mark.parametrize("parser, text, prose", FORMATS)
def test_the_head_comes_when_the_arguments_open_then_pieces_as_written(parser, text, prose):
    steps = by_char(parser, text)
    heads = [i for i, deltas in enumerate(steps) for d in deltas for p in d.get("tool_calls", ()) if "id" in p]
    assert heads == [text.index('{"city"')]  # not one character earlier (the name was not yet known to end)
    pieces = [p["function"]["arguments"] for deltas in steps for d in deltas for p in d.get("tool_calls", ())
              if "id" not in p]
    assert len(pieces) > 10 and "".join(pieces) == '{"city": "Paris", "days": [1, 2]}'
    content, calls = reassemble([d for deltas in steps for d in deltas])
    assert content == prose and calls == [{"name": "get_weather", "arguments": '{"city": "Paris", "days": [1, 2]}'}]
    msg, finish = message(auto(parser), text, "stop")
    assert msg["content"] == (prose or None) and finish == "tool_calls"
    assert [c["function"] for c in msg["tool_calls"]] == calls


@pytest.mark.parametrize("parser, text, calls", [
    ("hermes", '<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n<tool_call>\n'
               '{"name": "b", "arguments": {}}\n</tool_call>', [("a", '{"x": 1}'), ("b", "{}")]),
    ("llama3_json", '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}',
     [("a", '{"x": 1}'), ("b", "{}")]),
    ("mistral", '[TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]',
     [("a", '{"x": 1}'), ("b", "{}")]),
    ("mistral", '[TOOL_CALLS]a[ARGS]{"x": 1}[TOOL_CALLS]b[ARGS]{}', [("a", '{"x": 1}'), ("b", "{}")]),
    # held whole and sent when the object closes: arguments as JSON text, before the name, or missing
    ("hermes", '<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call>', [("a", '{"x": 1}')]),
    ("llama3_json", '{"parameters": {"x": 1}, "name": "a"}', [("a", '{"x": 1}')]),
    ("llama3_json", '{"name": "a"}', [("a", "{}")]),
])
def test_each_call_in_turn(parser, text, calls):
    msg, finish = message(auto(parser), text, "stop")
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == calls
    assert msg["content"] is None and finish == "tool_calls"


@pytest.mark.parametrize("parser, text, calls, content", [
    # a marker in prose, or JSON that breaks before a call's arguments open: all of it is text
    ("hermes", "Calls look like <tool_call>{name} in my output", [], "Calls look like <tool_call>{name} in my output"),
    ("hermes", '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', [],
     '<tool_call>{"name": "f", "arguments": [1]}</tool_call>'),
    ("llama3_json", "{this is prose}", [], "{this is prose}"),
    ("mistral", "[TOOL_CALLS] sure thing", [], "[TOOL_CALLS] sure thing"),
    ("mistral", "[1, 2]", [], "[1, 2]"),
    # arguments that break once sent: they stay a valid JSON prefix, the rest is text
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1, oops}}</tool_call>', [("f", '{"a": 1,')],
     " oops}}</tool_call>"),
    ("llama3_json", '{"name": "f", "parameters": {"a": 01}}', [("f", '{"a":')], " 01}}"),
    # text after a call (or between calls) is text
    ("hermes", '<tool_call>{"name": "f", "arguments": {}}</tool_call> Done.', [("f", "{}")], " Done."),
    ("llama3_json", '{"name": "f", "parameters": {}}; and more', [("f", "{}")], "; and more"),
    ("mistral", '[{"name": "f", "arguments": {}}] ok', [("f", "{}")], " ok"),
])
def test_what_is_not_a_call_is_text(parser, text, calls, content):
    deltas, stream = streamed(auto(parser), list(text))
    got_content, got_calls = reassemble(deltas)
    assert [(c["name"], c["arguments"]) for c in got_calls] == calls and got_content == content
    assert stream.finish_reason("stop") == ("tool_calls" if calls else "stop")


def test_a_call_cut_by_max_tokens_keeps_what_was_sent():
    text = '<tool_call>{"name": "f", "arguments": {"city": "Par'
    msg, finish = message(auto("hermes"), text, "length")
    assert msg["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"city": "Par'} and finish == "length"


def test_without_parallel_calls_later_calls_are_dropped():
    text = '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}'
    deltas, _ = streamed(auto("llama3_json", parallel=False), list(text))
    assert reassemble(deltas) == ("", [{"name": "a", "arguments": '{"x": 1}'}])


def test_a_possible_marker_is_held_until_it_is_not():
    steps = by_char("mistral", "[TOOL_CALLS]")
    assert not any(steps[:-1]) and steps[-1] == [{"content": "[TOOL_CALLS]"}]
    stream = ToolCallStream(auto("hermes"))
    assert stream.feed("a <tool") == [{"content": "a "}] and stream.feed("box") == [{"content": "<toolbox"}]


# -- any text, cut anywhere ---------------------------------------------------------------------------

NAMES = st.from_regex(r"[a-z_][a-z0-9_]{0,6}", fullmatch=True)
SCALARS = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | \
    st.text(max_size=4)
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner,
                                                                                         max_size=3), max_leaves=6)
ARGS = st.dictionaries(st.text(max_size=4), JSON, max_size=3)
SEPARATORS = st.sampled_from([(", ", ": "), (",", ":"), (" ,\n", " :\t")])


@st.composite
def call_texts(draw, parser: str) -> tuple[str, int, str]:
    """(text, where the calls start, the content around them) in `parser`'s format, well formed."""
    sep = draw(SEPARATORS)
    key = "parameters" if parser == "llama3_json" else "arguments"
    calls = []
    for name, args in draw(st.lists(st.tuples(NAMES, ARGS), min_size=1, max_size=3)):
        dumped = json.dumps(args, separators=sep, ensure_ascii=draw(st.booleans()))
        shape = draw(st.sampled_from(["name first", "name first", "arguments first", "as text", "no arguments"]))
        if shape == "name first":
            calls.append(f'{{"name"{sep[1]}{json.dumps(name)}{sep[0]}"{key}"{sep[1]}{dumped}}}')
        elif shape == "arguments first":
            calls.append(f'{{"{key}"{sep[1]}{dumped}{sep[0]}"name"{sep[1]}{json.dumps(name)}}}')
        elif shape == "as text":
            calls.append(json.dumps({"name": name, key: dumped}, separators=sep))
        else:
            calls.append(json.dumps({"name": name}, separators=sep))
    if parser == "hermes":  # text before and between the calls is content
        prose, between = draw(st.sampled_from(["", "Let me check. ", "a < b, [x] {y}\n"])), \
            draw(st.sampled_from(["\n", "", " \n"]))
        return prose + between.join(f"<tool_call>\n{c}\n</tool_call>" for c in calls), len(prose), \
            prose + between * (len(calls) - 1)
    if parser == "llama3_json":
        start = draw(st.sampled_from(["", "<|python_tag|>", " "]))
        return start + "; ".join(calls), 0, start.replace(PYTHON_TAG, "")
    return draw(st.sampled_from(["[TOOL_CALLS]", "[TOOL_CALLS] ", ""])) + "[" + sep[0].join(calls) + "]", 0, ""


@st.composite
def texts(draw) -> tuple[str, str, tuple[int, str] | None]:
    """(parser, text, (where the calls start, the content) or None when the text was damaged)."""
    parser = draw(st.sampled_from(["hermes", "llama3_json", "mistral"]))
    text, start, content = draw(call_texts(parser))
    damage = draw(st.sampled_from([None, "cut", "insert", "append"]))
    if damage is None:
        return parser, text, (start, content)
    at = draw(st.integers(0, len(text)))
    if damage == "cut":
        return parser, text[:at], None
    stray = draw(st.sampled_from(["x", '"', "}", "]", ",", " ", "\\", "<tool_call>", "[TOOL_CALLS]", "\x00"]))
    return parser, (text[:at] + stray + text[at:] if damage == "insert" else text + stray), None


@settings(max_examples=300, deadline=None)
@given(case=texts(), cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=15),
       parallel=st.booleans())
def test_any_text_cut_anywhere_joins_to_the_whole_message(case, cuts, parallel):
    parser, text, well_formed = case
    plan = auto(parser, parallel)
    whole, finish = message(plan, text, "stop")
    bounds = [0] + sorted(set(c for c in cuts if c < len(text))) + [len(text)]
    for pieces in ([text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)], list(text)):
        deltas, stream = streamed(plan, pieces)
        content, calls = reassemble(deltas)
        assert calls == [c["function"] for c in whole.get("tool_calls", [])]
        assert (content if content.strip() or not calls else None) == whole["content"]
        assert stream.finish_reason("stop") == finish
    if well_formed is not None:  # the parser's own calls, and the text around them as content
        start, expected_content = well_formed
        parsed = get_parser(parser).parse(text[start:])
        assert parsed is not None
        expected = parsed if parallel else parsed[:1]
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole["tool_calls"]] == \
            [(c.name, json.loads(c.arguments)) for c in expected]
        assert whole["content"] == (expected_content if expected_content.strip() else None)
