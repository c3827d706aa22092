"""/tokenize, /detokenize and /version as vLLM shapes them: the ids are the ones a completion computes
(its usage counts them), chat messages go through the chat template, a round trip gives the text back,
and bad input is a 400 naming the field. Also: `top_logprobs` without `logprobs` is refused, as vLLM
does."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server_support import InProcessServer, metric_value

MODEL = "test-model"
KEY = "k" * 32


@pytest.fixture(scope="module")
def server(tiny_dir):
    with InProcessServer(tiny_dir, model_name=MODEL, api_key=KEY) as srv:
        yield srv


def post(server, path: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.url + path, json=body, headers=headers, timeout=30)


def test_tokenize_gives_the_ids_a_completion_computes(server):
    r = post(server, "/tokenize", {"model": MODEL, "prompt": "héllo", "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    usage = client.completions.create(model=MODEL, prompt="héllo", max_tokens=1).usage
    assert body["count"] == len(body["tokens"]) == usage.prompt_tokens
    assert body["max_model_len"] == server.engine.max_model_len
    assert len(body["token_strs"]) == body["count"]
    back = post(server, "/detokenize", {"model": MODEL, "tokens": body["tokens"]})
    assert back.status_code == 200 and back.json()["prompt"].endswith("héllo"), back.text


def test_tokenize_messages_through_the_chat_template(server):
    messages = [{"role": "user", "content": "hi"}]
    r = post(server, "/tokenize", {"messages": messages})
    assert r.status_code == 200, r.text
    rendered = server.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert r.json()["tokens"] == server.engine.tokenizer.encode(rendered, add_special_tokens=False)
    assert r.json()["token_strs"] is None
    bare = post(server, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    assert bare["count"] < r.json()["count"]


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "x", "model": "other"}, "model"),
    ("/tokenize", {"prompt": "x", "unknown": 1}, "unknown"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/detokenize", {"tokens": [1, -2]}, "tokens"),
    ("/detokenize", {"tokens": [10**6]}, "tokens"),
])
def test_bad_input_is_a_400_naming_the_field(server, path, body, param):
    r = post(server, path, body)
    assert r.status_code in (400, 404), r.text
    error = r.json()["error"]
    assert param in (error.get("param") or "") + error["message"], error


def refused(server, route: str) -> float:
    try:
        return metric_value(httpx.get(server.url + "/metrics").text, "iterserve:http_responses_total",
                            route=route, code="401")
    except KeyError:  # no such answer yet
        return 0.0


def test_tokenizing_needs_the_api_key_and_is_counted(server):
    before = refused(server, "/tokenize"), refused(server, "/detokenize")
    assert post(server, "/tokenize", {"prompt": "x"}, key=None).status_code == 401
    assert post(server, "/detokenize", {"tokens": [1]}, key="wrong" * 8).status_code == 401
    assert (refused(server, "/tokenize"), refused(server, "/detokenize")) == (before[0] + 1, before[1] + 1)


def test_version_is_open(server):
    r = httpx.get(server.url + "/version")
    assert r.status_code == 200 and r.json()["version"]


def test_top_logprobs_without_logprobs_is_refused(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       top_logprobs=2)
    assert "top_logprobs" in str(e.value)
    ok = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                        logprobs=True, top_logprobs=2)
    assert len(ok.choices[0].logprobs.content[0].top_logprobs) == 2
