"""/admin/scheduler: the token guard, refusals that leave the engine unchanged, logged changes, and a
knob change under load that alters the batch without changing any greedy output."""

from __future__ import annotations

import asyncio
import logging
import socket

import httpx
import pytest

from tests.server_support import InProcessServer, metric_value

MODEL = "test-model"
ADMIN = {"Authorization": "Bearer admin-secret-for-tests"}


@pytest.fixture(scope="module")
def server(tiny_dir):
    with InProcessServer(tiny_dir, model_name=MODEL, api_key="user-key-for-tests", admin_token="admin-secret-for-tests",
                         max_num_seqs=2, kv_cache_memory="16MiB") as srv:
        yield srv


def test_a_patch_without_the_token_is_refused_unread(server):
    """The admin token is checked before the body is read: a client without it sends only a head that
    announces a large body, and gets its 401 (and a closed connection) rather than a wait for the body."""
    head = (b"PATCH /admin/scheduler HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 3000000\r\n\r\n")
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(head)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    assert received.startswith(b"HTTP/1.1 401"), received[:200]


def knobs(srv) -> dict:
    return srv.engine.knobs.as_dict()


def test_admin_needs_its_own_token(server):
    url = server.url + "/admin/scheduler"
    assert httpx.get(url).status_code == 401
    # the API key is not enough
    assert httpx.get(url, headers={"Authorization": "Bearer user-key-for-tests"}).status_code == 401
    assert httpx.patch(url, json={"max_num_seqs": 9}).status_code == 401
    assert httpx.patch(url, json={"max_num_seqs": 9}, headers={"Authorization": "Bearer nope"}).status_code == 401
    assert knobs(server)["max_num_seqs"] == 2
    body = httpx.get(url, headers=ADMIN).json()
    assert body["knobs"] == knobs(server)
    assert set(body["ranges"]) == {"max_num_seqs", "max_num_batched_tokens", "prefill_chunk_size"}
    # the admin token does not open the model API
    assert httpx.get(server.url + "/v1/models", headers=ADMIN).status_code == 401


@pytest.mark.parametrize("patch, param", [
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"max_num_seqs": -3}, "max_num_seqs"),
    ({"max_num_seqs": "8"}, "max_num_seqs"),
    ({"max_num_seqs": 2.5}, "max_num_seqs"),
    ({"prefill_chunk_size": 10**12}, "prefill_chunk_size"),
    ({"max_num_seqs": 4, "prefill_chunk_size": 0}, "prefill_chunk_size"),  # nothing of it applies
    ({"block_size": 32}, "block_size"),
    ({}, None),
])
def test_refused_patch_leaves_engine_unchanged(server, patch, param):
    before = (knobs(server), server.engine.snapshot()["num_knob_changes"])
    r = httpx.patch(server.url + "/admin/scheduler", json=patch, headers=ADMIN)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert (knobs(server), server.engine.snapshot()["num_knob_changes"]) == before


def test_patch_is_logged_with_old_and_new(server, caplog):
    old = knobs(server)["max_num_batched_tokens"]
    with caplog.at_level(logging.INFO, logger="iterserve.admin"):
        r = httpx.patch(server.url + "/admin/scheduler", json={"max_num_batched_tokens": 300}, headers=ADMIN)
    assert r.status_code == 200
    assert r.json()["changed"] == {"max_num_batched_tokens": {"old": old, "new": 300}}
    assert f"max_num_batched_tokens {old} -> 300" in caplog.text
    httpx.patch(server.url + "/admin/scheduler", json={"max_num_batched_tokens": old}, headers=ADMIN)


def _run_batch(srv, patch: dict | None) -> list[list[str]]:
    """12 concurrent greedy requests; with `patch`, the knobs change once the first tokens are out."""
    headers = {"Authorization": "Bearer user-key-for-tests"}

    async def one(client, i):
        body = {"model": MODEL, "prompt": list(range(1, 5 + 7 * i)), "max_tokens": 48, "temperature": 0,
                "ignore_eos": True, "logprobs": 1}
        r = await client.post(srv.url + "/v1/completions", json=body, headers=headers)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["logprobs"]["tokens"]

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            tasks = [asyncio.create_task(one(client, i)) for i in range(12)]
            if patch:
                while srv.engine.snapshot()["num_generated_tokens"] < 10:
                    await asyncio.sleep(0.005)
                r = await client.patch(srv.url + "/admin/scheduler", json=patch, headers=ADMIN)
                assert r.status_code == 200
            return await asyncio.gather(*tasks)

    return asyncio.run(main())


def test_patch_under_load_changes_batch_not_outputs(server):
    def wide_steps(text):  # steps in which more than 2 requests produced a token
        total = metric_value(text, "iterserve:step_sampled_requests_count")
        return total - metric_value(text, "iterserve:step_sampled_requests_bucket", le="2.0")

    before = knobs(server)
    baseline = _run_batch(server, None)
    m0 = httpx.get(server.url + "/metrics").text
    assert wide_steps(m0) == 0  # max_num_seqs=2 held throughout
    changed = _run_batch(server, {"max_num_seqs": 12, "prefill_chunk_size": 8, "max_num_batched_tokens": 64})
    m1 = httpx.get(server.url + "/metrics").text
    assert changed == baseline  # nothing dropped, nothing corrupted
    assert wide_steps(m1) > 0  # the next steps batched more requests
    assert metric_value(m1, "iterserve:max_num_seqs") == 12
    assert metric_value(m1, "iterserve:prefill_chunk_size") == 8
    assert metric_value(m1, "iterserve:knob_changes_total") >= 1
    httpx.patch(server.url + "/admin/scheduler", headers=ADMIN, json=before)


def test_admin_disabled_without_token(tiny_dir):
    with InProcessServer(tiny_dir, model_name=MODEL) as srv:
        r = httpx.get(srv.url + "/admin/scheduler")
        assert r.status_code == 401 and "--admin-token" in r.json()["error"]["message"]
