"""What one request may ask of the server: the body limit (checked after the API key), per-request limits
that name the refused field, `--max-queue` counting sequences, `priority` only under priority scheduling,
invalid Unicode refused by field, and a 500, should one happen, answered once, logged once and counted."""

from __future__ import annotations

import asyncio
import json
import logging
import socket

import httpx
import openai
import pytest

from iterserve.server.api.limits import ServerLimits
from tests.server_support import InProcessServer, metric_value

MODEL = "test-model"
KEY = "api-key-for-the-limit-tests"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_BYTES = 256 * 1024
LONG = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 400, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def server(tiny_dir):
    limits = ServerLimits(max_request_bytes=MAX_BYTES, max_prompt_tokens=1000)
    with InProcessServer(tiny_dir, model_name=MODEL, api_key=KEY, limits=limits, kv_cache_memory="16MiB") as srv:
        yield srv


def responses(srv, route: str, code: str) -> float:
    text = srv.state.metrics.render(False).decode()
    try:
        return metric_value(text, "iterserve:http_responses_total", route=route, code=code)
    except KeyError:
        return 0.0


def post(srv, body, path: str = "/v1/completions", headers=AUTH) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body)
    return httpx.post(srv.url + path, content=content, timeout=60,
                      headers={"content-type": "application/json", **headers})


def raw_exchange(srv, head: bytes) -> bytes:
    """Send only a request head on a fresh connection and read until the server has answered and closed
    the connection (a server that waited for the body would time this out)."""
    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as sock:
        sock.sendall(head)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
        return received


def head(content_length: int, headers: dict[str, str]) -> bytes:
    lines = ["POST /v1/completions HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json",
             f"Content-Length: {content_length}", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def error_of(raw: bytes) -> tuple[int, dict]:
    status_line, _, rest = raw.partition(b"\r\n")
    body = rest.partition(b"\r\n\r\n")[2]
    return int(status_line.split()[1]), json.loads(body)["error"]


def test_a_large_body_without_the_key_is_refused_unread(server):
    # the probe: a 53 MB body with no key was read whole before its 401. Now the 401 comes back
    # after the head alone, and the connection is closed, so the rest is never read
    before = responses(server, "/v1/completions", "401")
    status, error = error_of(raw_exchange(server, head(53_000_000, {})))
    assert status == 401 and error["code"] == "invalid_api_key"
    assert responses(server, "/v1/completions", "401") == before + 1


def test_body_over_the_limit_is_413(server):
    # declared: refused before a byte of the body is read
    status, error = error_of(raw_exchange(server, head(MAX_BYTES + 1, AUTH)))
    assert status == 413
    assert error["code"] == "request_too_large" and "--max-request-bytes" in error["message"]
    assert str(MAX_BYTES) in error["message"]
    # chunked (no Content-Length): refused once the body passes the limit
    def chunks():
        yield b'{"model": "test-model", "prompt": "'
        for _ in range(MAX_BYTES // 1024 + 1):
            yield b"y" * 1024
        yield b'", "max_tokens": 1}'

    r = httpx.post(server.url + "/v1/completions", content=chunks(), timeout=60,
                   headers={"content-type": "application/json", **AUTH})
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
    # just under the limit is served
    prompt = "z" * 400  # the tiny tokenizer: one token per byte
    padding = " " * (MAX_BYTES - len(json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 2})) - 1)
    r = post(server, json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 2}).encode() + padding.encode())
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "n": 129}, "n"),
    ({"prompt": "x", "stop": [f"s{i}" for i in range(17)]}, "stop"),
    ({"prompt": "x", "stop_token_ids": list(range(257))}, "stop_token_ids"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": ["x"] * 1025}, "prompt"),
    ({"prompt": ["x"] * 100, "n": 11}, "n"),  # 1100 sequences
    ({"prompt": [[1] * 300] * 4}, "prompt"),  # 1200 prompt tokens, over max_prompt_tokens 1000
    ({"prompt": [1] * 300, "n": 4}, "prompt"),  # each choice computes its prompt
    ({"prompt": "x", "priority": 1}, "priority"),  # not under fcfs
])
def test_per_request_limits_name_the_field(server, body, param):
    r = post(server, {"model": MODEL, "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": "x"}] * 4097}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}] * 257}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
])
def test_chat_limits_name_the_field(server, body, param):
    r = post(server, {"model": MODEL, "max_tokens": 2, **body}, path="/v1/chat/completions")
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("path, raw, param", [
    ("/v1/completions", b'{"prompt": "hi \\ud800", "max_tokens": 2}', "prompt"),  # the probe
    ("/v1/completions", b'{"prompt": ["ok", "hi \\udfff"], "max_tokens": 2}', "prompt[1]"),
    ("/v1/completions", b'{"prompt": "hi \xff\xfe", "max_tokens": 2}', "prompt"),  # not UTF-8 at all
    ("/v1/completions", b'{"prompt": "hi", "stop": ["\\ud83d"], "max_tokens": 2}', "stop[0]"),
    ("/v1/completions", b'{"prompt": "hi", "user": "\xc3", "max_tokens": 2}', "user"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi \\ud800"}]}', "messages[0].content"),
    ("/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc80"}]}]}',
     "messages[0].content[0].text"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi", "name": "\xed\xa0\x80"}]}',
     "messages[0].name"),
])
def test_invalid_unicode_is_400_naming_the_field(server, caplog, path, raw, param):
    fives = sum(responses(server, path, str(code)) for code in (500, 503))
    with caplog.at_level(logging.ERROR):
        r = post(server, raw, path=path)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and "Unicode" in error["message"]
    assert sum(responses(server, path, str(code)) for code in (500, 503)) == fives
    assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR]
    # a valid surrogate pair is fine
    assert post(server, b'{"prompt": "hi \\ud83d\\ude00", "max_tokens": 2}').status_code == 200


def test_an_unhandled_error_is_one_counted_500(server, caplog):
    """Fault injection: the chat template raises what the server does not expect (as a template bug
    would). The client gets an OpenAI-shaped 500, the error is logged once, and the 500 is counted."""
    uvicorn_records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = uvicorn_records.append
    logging.getLogger("uvicorn.error").addHandler(handler)  # uvicorn's loggers do not reach caplog
    tokenizer = server.engine.tokenizer
    real = tokenizer.apply_chat_template

    def broken(*args, **kwargs):
        raise RuntimeError("injected template failure")

    before = responses(server, "/v1/chat/completions", "500")
    tokenizer.apply_chat_template = broken
    try:
        with caplog.at_level(logging.ERROR, logger="iterserve.server"):
            client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
            with pytest.raises(openai.InternalServerError) as e:
                client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    finally:
        tokenizer.apply_chat_template = real
        logging.getLogger("uvicorn.error").removeHandler(handler)
    assert e.value.body["code"] == "internal_error" and "RuntimeError" in e.value.message
    assert responses(server, "/v1/chat/completions", "500") == before + 1
    logged = [rec for rec in caplog.records if rec.exc_info]
    assert len(logged) == 1 and "injected template failure" in str(logged[0].exc_info[1])
    assert not [rec for rec in uvicorn_records if rec.levelno >= logging.ERROR]


def test_priority_is_honoured_only_under_priority_scheduling(tiny_dir):
    with InProcessServer(tiny_dir, model_name=MODEL, scheduling_policy="priority") as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        r = client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"priority": -5})
        assert r.choices[0].finish_reason in ("length", "stop")


def test_max_queue_counts_sequences(tiny_dir):
    with InProcessServer(tiny_dir, model_name=MODEL, max_queue=8, max_num_seqs=1, kv_cache_memory="16MiB") as srv:
        async def until(key: str, count: int) -> None:
            async def wait():
                while srv.state.engine.snapshot()[key] < count:
                    await asyncio.sleep(0.01)
            await asyncio.wait_for(wait(), 60)

        async def main():
            async with httpx.AsyncClient(timeout=120) as client:
                url = srv.url + "/v1/completions"
                # more sequences than the whole queue: refused outright, naming the field and the flag
                for body, param in (({"prompt": ["a"] * 9}, "prompt"), ({"prompt": "a", "n": 9}, "n")):
                    r = await client.post(url, json={**LONG, **body})
                    assert r.status_code == 400 and r.json()["error"]["param"] == param
                    assert "--max-queue" in r.json()["error"]["message"]
                running = asyncio.create_task(client.post(url, json=LONG))
                await until("num_running", 1)
                five = asyncio.create_task(client.post(url, json={**LONG, "n": 5, "max_tokens": 2}))
                await until("num_waiting", 5)
                # 5 wait: 4 more would make 9 > 8 (one request, but four sequences)
                full = await client.post(url, json={**LONG, "prompt": [[1], [2], [3], [4]]})
                assert full.status_code == 429 and full.json()["error"]["code"] == "queue_full"
                three = await client.post(url, json={**LONG, "n": 3, "max_tokens": 2})  # 5 + 3 = 8 fit
                assert three.status_code == 200 and len(three.json()["choices"]) == 3
                for task in (running, five):
                    assert (await task).status_code == 200
        asyncio.run(main())
