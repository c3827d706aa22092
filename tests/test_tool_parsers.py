"""Tool-call parsing per family (`tool_parsers`) and the deltas of `tool_stream`: well-formed calls become
calls, malformed ones the text they were; streamed pieces, however the text is cut, join to the whole."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from iterserve.server.api.tool_calls import ToolPlan
from iterserve.server.api.tool_parsers import detect_parser, get_parser
from iterserve.server.api.tool_stream import message
from tests.test_tool_stream_auto import reassemble, streamed

TEMPLATES = Path(__file__).parent / "chat_templates"


def calls_of(parser: str, text: str):
    calls = get_parser(parser).parse(text)
    return None if calls is None else [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("parser, text, expected", [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     [("get_weather", {"city": "Paris"})]),
    ("hermes", '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>\n'
               '{"name": "b", "arguments": {}}\n</tool_call>', [("a", {"x": 1}), ("b", {})]),
    ("hermes", '<tool_call>{"name": "a", "arguments": "{\\"x\\": 2}"}', [("a", {"x": 2})]),  # unclosed, args as text
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', [("get_weather", {"city": "Paris"})]),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {}}', [("f", {})]),
    ("llama3_json", '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {"y": [2]}}',
     [("a", {"x": 1}), ("b", {"y": [2]})]),
    ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {"q": "x"}}, {"name": "g", "arguments": {}}]',
     [("f", {"q": "x"}), ("g", {})]),
    ("mistral", '[{"name": "f", "arguments": {"q": "x"}}]', [("f", {"q": "x"})]),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"q": 1}[TOOL_CALLS]g[ARGS]{}', [("f", {"q": 1}), ("g", {})]),
])
def test_each_family_parses(parser, text, expected):
    assert calls_of(parser, text) == expected


@pytest.mark.parametrize("parser, text", [
    ("hermes", "<tool_call>{not json}</tool_call>"),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>'),  # no name
    ("hermes", '<tool_call>{"name": "f", "arguments": [1]}</tool_call>'),  # arguments not an object
    ("hermes", '<tool_call>{"name": "f", "arguments": {}}</tool_call> and then some words'),
    ("hermes", '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": 5}</tool_call>'),
    ("llama3_json", '{"name": "f", "parameters": {"x": '),  # cut by max_tokens
    ("llama3_json", '{"name": "f"} trailing prose'),
    ("llama3_json", "{}"),
    ("mistral", "[TOOL_CALLS] [1, 2]"),
    ("mistral", "[TOOL_CALLS] not json"),
    ("mistral", "[TOOL_CALLS]f{}"),
    ("hermes", '<tool_call>{"name": "f", "arguments": ' + "[" * 100_000 + "</tool_call>"),
    ("llama3_json", '{"name": "f", "parameters": ' + "[" * 100_000),
])
def test_malformed_calls_are_not_calls(parser, text):
    assert get_parser(parser).parse(text) is None


@pytest.mark.parametrize("parser, text", [
    ("hermes", "I'd say <tool_call>{broken"),
    ("llama3_json", '{"name": oops'),
    ("mistral", "[not a call]"),
])
def test_malformed_output_falls_back_to_text(parser, text):
    msg, finish = message(ToolPlan("auto", parser=get_parser(parser)), text, "stop")
    assert msg == {"role": "assistant", "content": text} and finish == "stop"


def test_text_before_hermes_calls_is_content():
    text = 'Let me look.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    msg, finish = message(ToolPlan("auto", parser=get_parser("hermes")), text, "stop")
    assert msg["content"] == "Let me look.\n" and finish == "tool_calls"
    (call,) = msg["tool_calls"]
    assert call["function"] == {"name": "f", "arguments": '{"a": 1}'} and call["id"].startswith("call_")


def test_auto_without_parallel_calls_keeps_the_first():
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>'
    msg, _ = message(ToolPlan("auto", parser=get_parser("hermes"), parallel=False), text, "stop")
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["a"]


def test_a_call_cut_by_max_tokens_keeps_length():
    text = '[{"name":"f","parameters":{"a":'
    msg, finish = message(ToolPlan("required"), text, "length")
    assert finish == "length" and msg["tool_calls"][0]["function"]["arguments"] == '{"a":'


def test_mistral_ids_are_nine_characters():
    msg, _ = message(ToolPlan("auto", parser=get_parser("mistral")), '[{"name": "f", "arguments": {}}]', "stop")
    assert len(msg["tool_calls"][0]["id"]) == 9 and msg["tool_calls"][0]["id"].isalnum()


@pytest.mark.parametrize("template, parser", [("qwen2_5.jinja", "hermes"), ("llama3_1.jinja", "llama3_json"),
                                              ("mistral_v3.jinja", "mistral")])
def test_parser_is_detected_from_the_template(template, parser):
    assert detect_parser((TEMPLATES / template).read_text()).name == parser


def test_a_template_without_tool_markup_has_no_parser():
    from tests.server_support import TINY_CHAT_TEMPLATE

    assert detect_parser(TINY_CHAT_TEMPLATE) is None and detect_parser(None) is None


FORCED = ('[{"name":"get_weather","parameters":{"city":"P\\"a]},ris","days":[1,{"x":"}"}]}},'
          '{"name":"f","parameters":{}}]')
CASES = [
    (ToolPlan("required"), FORCED),
    (ToolPlan("named", function="get_weather"), '{"city":"Paris","unit":"celsius"}'),
    (ToolPlan("auto", parser=get_parser("hermes")),
     'Sure.<tool_call>\n{"name": "f", "arguments": {"a": "<tool_call>"}}\n</tool_call>'),
    (ToolPlan("auto", parser=get_parser("hermes")), "plain text with a < and <tool_ but no call"),
    (ToolPlan("auto", parser=get_parser("llama3_json")), '  <|python_tag|>{"name": "f", "parameters": {"a": 1}}'),
    (ToolPlan("auto", parser=get_parser("llama3_json")), "  {not a call, so text"),
    (ToolPlan("auto", parser=get_parser("mistral")), '[TOOL_CALLS] [{"name": "f", "arguments": {"b": [1]}}]'),
]


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=12))
def test_streamed_deltas_join_to_the_whole_message(case, cuts):
    plan, text = case
    whole, finish = message(plan, text, "stop")
    bounds = [0] + sorted(set(c for c in cuts if c < len(text))) + [len(text)]
    deltas, stream = streamed(plan, [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)])
    content, calls = reassemble(deltas)
    assert calls == [c["function"] for c in whole.get("tool_calls", [])]
    assert (content if content.strip() or not calls else None) == whole["content"]
    assert stream.finish_reason("stop") == finish


def test_required_stream_splits_each_call():
    plan = ToolPlan("required")
    msg, finish = message(plan, FORCED, "stop")
    assert finish == "tool_calls"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == [
        ("get_weather", {"city": 'P"a]},ris', "days": [1, {"x": "}"}]}), ("f", {})]
    assert msg["content"] is None


def _plan(body: dict, template: str | None, setting: str = "auto"):
    from iterserve.server.api.protocol import ChatCompletionRequest, parse_body
    from iterserve.server.api.tool_calls import plan_tools

    req = parse_body(ChatCompletionRequest, json.dumps({"messages": [{"role": "user", "content": "hi"}],
                                                         **body}).encode(), "application/json")
    return plan_tools(req, template, setting)


TOOL = {"type": "function", "function": {"name": "f"}}


def test_the_parser_flag_overrides_the_template():
    qwen = (TEMPLATES / "qwen2_5.jinja").read_text()
    assert _plan({"tools": [TOOL]}, qwen).parser.name == "hermes"
    assert _plan({"tools": [TOOL]}, qwen, "llama3_json").parser.name == "llama3_json"
    assert _plan({"tools": [TOOL]}, None) is None  # no parser known: auto is text
    assert _plan({"tools": [TOOL], "tool_choice": "none"}, qwen) is None


def test_serve_takes_vllm_tool_flags():
    from iterserve.server.entrypoints.cli import build_parser

    args = build_parser().parse_args(["serve", "--enable-auto-tool-choice", "--tool-call-parser", "mistral"])
    assert args.tool_call_parser == "mistral"
    assert build_parser().parse_args(["serve"]).tool_call_parser == "auto"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--tool-call-parser", "pythonic"])


def test_forced_plans_carry_their_grammar():
    from iterserve.server.api.tool_calls import NO_PARAMETERS

    named = _plan({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "f"}}}, None)
    assert named.mode == "named" and json.loads(named.structured.json_schema) == NO_PARAMETERS
    required = _plan({"tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": False}, None)
    schema = json.loads(required.structured.json_schema)
    assert schema["maxItems"] == 1 and schema["items"]["properties"]["name"] == {"const": "f"}
