"""Prefix caching served, with the engine core in its own process: the official openai client reads
`usage.prompt_tokens_details.cached_tokens` (chat and completions, streamed or not), /metrics counts
vLLM's prefix cache queries and hits in tokens and leaves cached-but-free blocks out of
vllm:kv_cache_usage_perc (and so out of the tuner's KV pressure reading), and
POST /admin/reset_prefix_cache behind the admin token makes the engine forget every prefix.
Speed is the benchmark's business (benchmarks/prefix_cache.py): nothing here is timed."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from iterserve.bench.workload import words_prompt
from iterserve.operator.tuning.observation import KV_USAGE
from iterserve.operator.tuning.observe import parse_scrape
from tests.server_support import InProcessServer, metric_value
from tests.waiting import wait_until

ADMIN_TOKEN = "admin-secret-for-prefix-tests"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def metrics(srv) -> str:
    return httpx.get(srv.url + "/metrics").text


def counters(srv) -> tuple[float, float]:
    text = metrics(srv)
    return metric_value(text, "vllm:prefix_cache_queries_total"), metric_value(text, "vllm:prefix_cache_hits_total")


def wait_idle(srv, timeout: float = 30) -> None:
    wait_until(lambda: metric_value(metrics(srv), "vllm:num_requests_running") <= 0, timeout=timeout,
               what="no request running", interval=0.05)


@pytest.mark.slow
def test_a_shared_1000_token_prefix_is_reported_cached():
    with InProcessServer(None, model_name="smol", kv_cache_memory="160MiB", max_model_len=2048,
                         admin_token=ADMIN_TOKEN) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        system = {"role": "system", "content": words_prompt(1010, seed=1)}  # about 1,010 tokens

        def ask(question: str, **kw):
            return client.chat.completions.create(model="smol",
                                                  messages=[system, {"role": "user", "content": question}],
                                                  max_tokens=4, temperature=0, **kw)

        first = ask("What is the capital of France?")
        assert first.usage.prompt_tokens > 1000
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        queries, hits = counters(srv)
        assert (queries, hits) == (first.usage.prompt_tokens, 0)

        second = ask("And of Germany?")
        cached = second.usage.prompt_tokens_details.cached_tokens
        # the system prompt and the template around it, in whole 16-token blocks, up to the question
        assert 1000 <= cached < second.usage.prompt_tokens and cached % 16 == 0, second.usage
        assert counters(srv) == (first.usage.prompt_tokens + second.usage.prompt_tokens, cached)

        # streamed: the usage chunk reports it too
        stream = ask("And of Italy?", stream=True, stream_options={"include_usage": True})
        usage = [c.usage for c in stream if c.usage is not None][-1]
        assert usage.prompt_tokens_details.cached_tokens >= 1000

        # idle, the pool holds cached prefixes that no request uses: free, not usage, not KV pressure
        wait_idle(srv)
        text = metrics(srv)
        assert metric_value(text, "vllm:kv_cache_usage_perc") == 0.0
        assert metric_value(text, "iterserve:kv_cache_cached_free_perc") > 0.0
        assert parse_scrape(text, time.monotonic()).gauges[KV_USAGE] == 0.0

        # the reset: admin token only; afterwards nothing is cached
        url = srv.url + "/admin/reset_prefix_cache"
        assert httpx.post(url).status_code == 401
        assert httpx.post(url, headers={"Authorization": "Bearer wrong-token-of-enough-length"}).status_code == 401
        r = httpx.post(url, headers=ADMIN)
        assert r.status_code == 200 and r.json()["prefix_caching"] is True
        assert r.json()["num_blocks_forgotten"] >= 1000 // 16
        assert metric_value(metrics(srv), "iterserve:kv_cache_cached_free_perc") == 0.0
        assert ask("And of Spain?").usage.prompt_tokens_details.cached_tokens == 0


def test_completions_report_cached_tokens_and_the_flag_turns_caching_off(tiny_dir):
    prompt = list(range(40, 140))  # 100 token ids
    for enabled, expected in ((True, 96), (False, 0)):
        with InProcessServer(tiny_dir, model_name="tiny", admin_token=ADMIN_TOKEN,
                             enable_prefix_caching=enabled) as srv:
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
            first = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0)
            second = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0)
            assert first.usage.prompt_tokens_details.cached_tokens == 0
            assert second.usage.prompt_tokens_details.cached_tokens == expected
            assert second.choices[0].text == first.choices[0].text
            # n=2 of one prompt: usage counts the prompt once, cached as the choice that found least
            both = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0, n=2)
            assert both.usage.prompt_tokens == 100 and both.usage.prompt_tokens_details.cached_tokens == expected
            stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0,
                                               stream=True, stream_options={"include_usage": True})
            assert [c.usage for c in stream if c.usage][-1].prompt_tokens_details.cached_tokens == expected
            r = httpx.post(srv.url + "/admin/reset_prefix_cache", headers=ADMIN)
            assert r.status_code == 200 and r.json()["prefix_caching"] is enabled
            assert counters(srv)[1] == 4 * expected  # second, the two choices, the stream
