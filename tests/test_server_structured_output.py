"""`response_format` through the server and the official `openai` client: json_schema and json_object give
JSON that parses and validates (the tiny random model could not write it without the grammar), streamed
or not; a bad schema is a 400 naming `response_format.json_schema.schema` (checked in the engine core's process,
which queues nothing of the request), streamed or not, before any byte of a stream."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from iterserve.server.engine.structured_output import check_schema
from iterserve.server.errors import InvalidRequestError
from tests.server_support import InProcessServer, metric_value, wait_idle, with_special_eos

MODEL = "test-model"
WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 12},
                          "unit": {"enum": ["celsius", "fahrenheit"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 14},
                          "alerts": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                                     "maxItems": 2}},
           "required": ["city", "unit", "days", "alerts"], "additionalProperties": False}
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER, "strict": True}}
MESSAGES = [{"role": "user", "content": "Weather in Paris for three days, as JSON."}]


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    model = with_special_eos(tiny_dir, tmp_path_factory.mktemp("tiny-json-served"))
    with InProcessServer(model, model_name=MODEL) as srv:  # the engine core in its own process
        yield srv


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_json_schema_chat_validates(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format=SCHEMA_FORMAT,
                                       max_tokens=300, temperature=1.0, seed=3, n=3)
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), WEATHER)


def test_json_schema_completion_greedy(client):
    r = client.completions.create(model=MODEL, prompt="weather:", max_tokens=300, temperature=0,
                                  extra_body={"response_format": SCHEMA_FORMAT})
    (choice,) = r.choices
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.text), WEATHER)


def test_json_object_chat(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format={"type": "json_object"},
                                       max_tokens=400, temperature=0)
    (choice,) = r.choices
    # greedy on this model closes the object well inside max_tokens (a random draw may nest deeper)
    assert choice.finish_reason == "stop"
    assert isinstance(json.loads(choice.message.content), dict)


def test_streaming_json_schema(client):
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format=SCHEMA_FORMAT,
                                            max_tokens=300, temperature=1.0, seed=11, stream=True)
    parts, finish = [], None
    for chunk in stream:
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert finish == "stop" and len([p for p in parts if p]) > 1
    jsonschema.validate(json.loads("".join(parts)), WEATHER)


def test_text_format_is_unconstrained(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format={"type": "text"},
                                       max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"


@pytest.mark.parametrize("fmt, param, words", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nothing"}}},
     "response_format.json_schema.schema", "Unsupported type"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(a"}}},
     "response_format.json_schema.schema", "parenthesis"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": 3, "maximum": 1}}},
     "response_format.json_schema.schema", "minimum greater than maximum"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1, 2]}},
     "response_format.json_schema.schema", ""),
    ({"type": "json_schema"}, "response_format", "json_schema"),
    ({"type": "yaml"}, "response_format.type", ""),
    ({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema.name", ""),
])
def test_bad_response_format_is_a_400_naming_the_field(client, server, fmt, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format=fmt, max_tokens=5)
    err = e.value.body
    assert e.value.status_code == 400 and err["param"] == param and words in err["message"], err
    assert server.engine.snapshot()["num_waiting"] == 0  # nothing reached the engine


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_bad_schema_is_a_400_before_any_stream_byte(server, route, stream):
    """The core checks the schema and queues none of the n choices; the answer is the 400 the check in this
    process gives, word for word, and a stream never starts. The next request runs as usual."""
    bad = {"type": "string", "pattern": "(a"}
    with pytest.raises(InvalidRequestError) as expected:
        check_schema(json.dumps(bad))
    body = {"model": MODEL, "max_tokens": 5, "n": 2, "stream": stream,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": bad}},
            **({"messages": MESSAGES} if "chat" in route else {"prompt": "weather:"})}
    before = metric_value(httpx.get(server.url + "/metrics").text, "vllm:request_params_n_count")
    with httpx.stream("POST", server.url + route, json=body, timeout=30) as r:
        assert r.status_code == 400 and r.headers["content-type"] == "application/json"
        err = json.loads(r.read())["error"]
    assert err == {"message": str(expected.value), "type": "invalid_request_error",
                   "param": "response_format.json_schema.schema", "code": "invalid_value"}
    assert server.engine.num_in_flight == 0 and server.engine.num_prompt_tokens_pending == 0
    metrics = wait_idle(server.url)  # nothing waits, runs or holds KV blocks
    assert metric_value(metrics, "vllm:request_params_n_count") == before  # not counted as a request
    body["response_format"]["json_schema"]["schema"] = WEATHER
    body["max_tokens"] = 300
    r = httpx.post(server.url + route, json=body, timeout=120)
    assert r.status_code == 200 and len(r.text) > 0
