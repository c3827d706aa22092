"""The server through the official `openai` client, sync and async: completions, chat, streaming with
usage, stop strings, n, seeds, logprobs, and errors arriving as the client's exception types.

The tiny random model (with a byte-level tokenizer added) serves where only the mechanics matter;
the bundled SmolLM2 serves where the text must make sense.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from tests.server_support import InProcessServer

MODEL = "test-model"


@pytest.fixture(scope="module")
def server(tiny_dir):
    with InProcessServer(tiny_dir, model_name=MODEL) as srv:
        yield srv


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_completion_usage_and_length(client):
    r = client.completions.create(model=MODEL, prompt="hello there", max_tokens=7, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.model == MODEL
    (choice,) = r.choices
    assert choice.finish_reason == "length"
    assert r.usage.prompt_tokens == len(b"hello there")  # one token per byte
    assert r.usage.completion_tokens == 7 and r.usage.total_tokens == r.usage.prompt_tokens + 7


def test_completion_prompt_forms_and_n(client):
    r = client.completions.create(model=MODEL, prompt=[[1, 2, 3], [4, 5]], n=2, max_tokens=3,
                                  temperature=0.8, seed=5)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 12


def test_seed_reproducible_and_choices_differ(client):
    def run():
        r = client.completions.create(model=MODEL, prompt="seed me", n=2, max_tokens=12, temperature=1.0,
                                      seed=1234, extra_body={"ignore_eos": True})
        return [c.text for c in sorted(r.choices, key=lambda c: c.index)]

    first = run()
    assert run() == first
    assert first[0] != first[1]  # each of n choices draws its own sample


def test_stop_string_cuts_text(client):
    full = client.completions.create(model=MODEL, prompt="abc", max_tokens=20, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = full[6:8]
    cut = client.completions.create(model=MODEL, prompt="abc", max_tokens=20, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True}).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full[: full.find(stop)]


def test_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=4, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == 4 and all(v <= 0 for v in lp.token_logprobs)
    for token, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        # greedy: the chosen token is the most likely, and the alternatives are no more likely
        assert 1 <= len(top) <= 3 and top[token] == chosen == max(top.values())
    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == 3
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == entry.logprob >= entry.top_logprobs[1].logprob


def test_chat_stream_matches_non_stream_and_reports_usage(client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10,
                                          temperature=0, extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10,
                                                 temperature=0, stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_raw_stream_ends_with_done(server):
    with httpx.stream("POST", server.url + "/v1/completions", timeout=30,
                      json={"model": MODEL, "prompt": "q", "max_tokens": 3, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)


def test_stream_sends_a_chunk_per_token_even_while_a_character_is_held_back(client):
    # The tiny tokenizer has one token per byte, so the random model's bytes above 0x7f form characters
    # over several tokens; those tokens' chunks carry empty text (the character comes whole in a later
    # one), as vLLM streams them, so a client's inter-chunk gap is one engine step, never two.
    kwargs = dict(model=MODEL, prompt="hello", max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs)
    chunks = [c for c in client.completions.create(**kwargs, stream=True) if c.choices]
    assert len(chunks) == 40
    assert any(c.choices[0].text == "" for c in chunks)  # some character did span tokens
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text


def test_stream_flushes_tokens_while_the_request_runs(server):
    # The first tokens reach the client while the engine is still generating the rest (not in one
    # burst at the end): after the first content chunk, the request is still counted as running.
    stream = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0).completions.create(
        model=MODEL, prompt="q", max_tokens=400, temperature=0, stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    first = next(chunks)
    assert first.choices[0].text is not None
    assert server.state.engine.snapshot()["num_running"] == 1
    rest = list(chunks)
    assert rest[-1].choices[0].finish_reason == "length"
    assert len(rest) >= 100  # tokens come in many chunks, not a few bursts


def test_async_client_concurrent(server):
    async def main():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        async def one(i):
            stream = await client.completions.create(model=MODEL, prompt=f"p{i}", max_tokens=5, stream=True,
                                                     temperature=0, extra_body={"ignore_eos": True})
            return [c async for c in stream]
        results = await asyncio.gather(*(one(i) for i in range(16)))
        await client.close()
        return results

    for chunks in asyncio.run(main()):
        assert chunks[-1].choices[0].finish_reason == "length"


def test_errors_as_client_exceptions(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=600)
    assert e.value.body["param"] == "max_tokens"
    assert "600" in e.value.message and "512" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[])
    assert e.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=[[1, 99999]], max_tokens=2)
    assert e.value.body["param"] == "prompt"


def test_api_key(tiny_dir):
    with InProcessServer(tiny_dir, model_name=MODEL, api_key="sekret-api-key-for-tests") as srv:
        bad = openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        assert httpx.post(srv.url + "/v1/completions", json={"prompt": "x"}).status_code == 401
        good = openai.OpenAI(base_url=srv.url + "/v1", api_key="sekret-api-key-for-tests", max_retries=0)
        assert good.completions.create(model=MODEL, prompt="x", max_tokens=2).choices
        assert httpx.get(srv.url + "/health").status_code == 200  # probes need no key


@pytest.mark.slow
def test_default_model_chat():
    with InProcessServer(None, model_name="smol", kv_cache_memory="64MiB", max_model_len=1024) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        r = client.chat.completions.create(model="smol", messages=messages, max_tokens=24, temperature=0)
        assert "Paris" in r.choices[0].message.content
        stream = client.chat.completions.create(model="smol", messages=messages, max_tokens=24, temperature=0,
                                                stream=True)
        arrivals = []
        for c in stream:
            arrivals.append((time.monotonic(), c.choices[0].delta.content or "" if c.choices else ""))
        assert "".join(t for _, t in arrivals) == r.choices[0].message.content
        # tokens flush as steps produce them: chunks arrive spread out, not in one burst at the end
        gaps = [b[0] - a[0] for a, b in zip(arrivals[1:], arrivals[2:], strict=False)]
        assert sum(g > 0.002 for g in gaps) >= len(gaps) // 2, gaps
        stopped = client.chat.completions.create(model="smol", messages=messages, max_tokens=24, temperature=0,
                                                 stop=["Paris"])
        assert "Paris" not in stopped.choices[0].message.content and stopped.choices[0].finish_reason == "stop"
