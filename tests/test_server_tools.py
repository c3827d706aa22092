"""Tool calling through the server and the official `openai` client, on a tiny random model served with
Qwen2.5's tools-aware template: forced calls (`required`, named) validate against the tools' schemas (the
random model could not write them without the grammar), `auto` leaves text alone, a tool round trip is
rendered through the template, streamed calls reassemble to the non-streamed ones (an `auto` call in
pieces as it is written), bad input is a 400."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from tests.server_support import InProcessServer, with_special_eos

MODEL = "test-model"
TEMPLATES = Path(__file__).parent / "chat_templates"
WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 10},
                          "unit": {"enum": ["celsius", "fahrenheit"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 14}},
           "required": ["city", "unit", "days"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
         "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
MESSAGES = [{"role": "user", "content": "What's the weather in Paris?"}]


def tools_model(tiny_dir, tmp_path_factory) -> str:
    model = Path(with_special_eos(tiny_dir, tmp_path_factory.mktemp("tiny-tools")))
    config = {"chat_template": (TEMPLATES / "qwen2_5.jinja").read_text(), "eos_token": "<|im_end|>"}
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    # the template's tool prompt is ~1000 tokens of this byte-level vocabulary: room for it (random weights)
    model_config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**model_config, "max_position_embeddings": 2048}))
    return str(model)


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    with InProcessServer(tools_model(tiny_dir, tmp_path_factory), model_name=MODEL) as srv:
        yield srv


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def check_calls(choice, names=None):
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]


def test_required_calls_validate(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=200, temperature=1.0, seed=5, n=4)
    for choice in r.choices:
        assert len(check_calls(choice)) == 1


def test_required_parallel_calls_validate(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                       max_tokens=400, temperature=1.0, seed=1, n=3)
    for choice in r.choices:
        assert check_calls(choice)


def test_named_call_validates(client):
    choice = {"type": "function", "function": {"name": "get_time"}}
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                       max_tokens=100, temperature=1.0, seed=2, n=3)
    for c in r.choices:
        assert [name for name, _ in check_calls(c, {"get_time"})] == ["get_time"]


def test_auto_without_a_call_is_text(client):
    """A random model's free output is no well-formed <tool_call>: it comes back as the text it is, the
    same text that `none` (tools rendered, nothing parsed) gives."""
    kwargs = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=30, temperature=0)
    auto = client.chat.completions.create(**kwargs, tool_choice="auto").choices[0]
    none = client.chat.completions.create(**kwargs, tool_choice="none").choices[0]
    assert auto.message.tool_calls is None and auto.finish_reason in ("stop", "length")
    assert auto.message.content and auto.message.content == none.message.content
    chunks = list(client.chat.completions.create(**kwargs, tool_choice="auto", stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == auto.message.content
    assert not any(c.choices[0].delta.tool_calls for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == auto.finish_reason


def test_tool_round_trip_is_rendered_and_answered(client, server):
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=8, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.usage.prompt_tokens > 100
    ids = httpx.post(server.url + "/tokenize", json={"messages": messages, "tools": TOOLS}).json()["tokens"]
    assert len(ids) == r.usage.prompt_tokens
    text = httpx.post(server.url + "/detokenize", json={"tokens": ids}).json()["prompt"]
    assert "<tools>\n" + json.dumps(TOOLS[0]) + "\n" + json.dumps(TOOLS[1]) + "\n</tools>" in text
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius", "days": 1}}'
            '\n</tool_call><|im_end|>') in text
    assert '<|im_start|>user\n<tool_response>\n{"temperature": 21}\n</tool_response><|im_end|>' in text
    assert text.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_calls_reassemble_to_the_same_call(client, tool_choice):
    kwargs = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, max_tokens=300,
                  temperature=0)
    whole = check_calls(client.chat.completions.create(**kwargs).choices[0])
    calls: dict[int, list] = {}
    finish, pieces = None, 0
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            assert not c.delta.content
            for part in c.delta.tool_calls or ():
                if part.index not in calls:
                    assert part.id and part.type == "function" and part.function.name
                    calls[part.index] = [part.function.name, part.function.arguments or ""]
                else:
                    assert part.id is None and part.function.name is None
                    calls[part.index][1] += part.function.arguments
                    pieces += 1
    assert finish == "tool_calls" and pieces > 1  # the arguments came in pieces, as they were written
    assert [tuple(calls[i]) for i in sorted(calls)] == whole


# `auto` leaves the output to the model, and a random model writes no call of its own: a `response_format`
# schema makes it write Llama 3's bare-JSON call (served with `--tool-call-parser llama3_json`), which
# `auto` reads like any model's call. The grammar fixes the shape; the model still picks every token.
LLAMA_CALL = {"type": "object", "properties": {"name": {"const": "get_weather"}, "parameters": WEATHER},
              "required": ["name", "parameters"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llama_client(tiny_dir, tmp_path_factory):
    with InProcessServer(tools_model(tiny_dir, tmp_path_factory), model_name=MODEL,
                         tool_call_parser="llama3_json") as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


def test_auto_calls_stream_as_they_are_written(llama_client):
    kwargs = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="auto", max_tokens=300, temperature=0,
                  response_format={"type": "json_schema", "json_schema": {"name": "call", "schema": LLAMA_CALL}})
    whole = check_calls(llama_client.chat.completions.create(**kwargs).choices[0], {"get_weather"})
    chunks = list(llama_client.chat.completions.create(**kwargs, stream=True))
    calls: dict[int, list] = {}
    with_calls = []
    for n, chunk in enumerate(chunks):
        for c in chunk.choices:
            assert not c.delta.content
            for part in c.delta.tool_calls or ():
                with_calls.append(n)
                if part.index not in calls:
                    assert part.id and part.type == "function" and part.function.name == "get_weather"
                    calls[part.index] = [part.function.name, part.function.arguments or ""]
                else:
                    assert part.id is None and part.function.name is None
                    calls[part.index][1] += part.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # the head came long before the end, and the arguments in many pieces, as they were written
    assert with_calls[0] < len(chunks) - 2 and len(with_calls) > 3
    assert [tuple(calls[i]) for i in sorted(calls)] == whole


@pytest.mark.parametrize("change, param", [
    ({"tools": [{"type": "function", "function": {"parameters": WEATHER}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": "sometimes", "tools": TOOLS}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nothing"}}}],
      "tool_choice": "required"}, "tools[0].function.parameters"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools[2].function.name"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"messages": MESSAGES + [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "not json"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"messages": MESSAGES + [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[" * 100_000}}]}]},
     "messages[1].tool_calls[0].function.arguments"),  # deeper than the JSON decoder goes: still a 400
    ({"messages": [{"role": "user", "content": "hi", "tool_call_id": "c"}]}, "messages[0]"),
])
def test_bad_tool_input_is_a_400_naming_the_field(server, change, param):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 5, **change}
    r = httpx.post(server.url + "/v1/chat/completions", json=body)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and err["type"] == "invalid_request_error", err
    assert server.engine.snapshot()["num_waiting"] == 0  # nothing reached the engine


def test_the_clients_own_message_goes_back(client):
    """The round trip as a user writes it: the response's message object itself, then the tool's answer."""
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=200, temperature=0)
    msg = r.choices[0].message
    answer = {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "21 degrees"}
    follow = client.chat.completions.create(model=MODEL, messages=MESSAGES + [msg, answer], tools=TOOLS,
                                            max_tokens=5, temperature=0)
    assert follow.usage.prompt_tokens > r.usage.prompt_tokens + len(msg.tool_calls[0].function.arguments)
