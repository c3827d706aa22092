"""`iterserve router` in front of two real `iterserve serve` pods on the tiny random model, through the
official openai client: answers equal the pods' own, streams reassemble, load and prefixes steer, a pod
that dies is routed around, a client that leaves aborts its request on the pod."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import time

import httpx
import openai
import pytest

from tests.router_support import routed, router_gauge, start_pods, start_router, stop, wait_healthy
from tests.server_support import metric_value, wait_idle
from tests.waiting import wait_until

GREEDY = dict(temperature=0, max_tokens=12)
# exactly two tokens through the router: the random model samples its EOS now and then at temperature 1
TWO = dict(max_tokens=2, extra_body={"ignore_eos": True})
# two servers load at once for the module: minutes on a busy 2-core machine
pytestmark = pytest.mark.timeout(900)


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def serve_args(tiny_dir):
    return ("--model", tiny_dir, "--served-model-name", "m", "--kv-cache-memory", "16MiB")


@pytest.fixture(scope="module")
def pods(serve_args):
    """Two pods; one request runs at a time on each, so that queued work shows as `waiting`."""
    started = start_pods(2, *serve_args, "--max-num-seqs", "1")
    yield [url for _, url in started]
    for proc, _ in started:
        stop(proc)


@pytest.fixture
def router(pods):
    proc, url = start_router(*pods)
    wait_healthy(url, *pods)
    yield url
    out = stop(proc)
    assert "Traceback" not in out, out


def test_answers_through_the_router_equal_the_pods_own(pods, router):
    direct, via = _client(pods[0]), _client(router)
    assert [m.id for m in via.models.list().data] == [m.id for m in direct.models.list().data]
    model = direct.models.list().data[0].id
    prompts = ("The quick brown fox", "hello")
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    wants = [direct.completions.create(model=model, prompt=p, **GREEDY).choices[0].text for p in prompts]
    want_chat = direct.chat.completions.create(model=model, messages=messages, **GREEDY).choices[0].message.content
    # the direct requests reach the router only through its scrapes: until one after them, pods[0] looks busy
    # and least-load rightly sends everything to pods[1]
    wait_until(lambda: all(router_gauge(router, "iterserve:router_pod_requests", p) == 0 for p in pods),
               timeout=30, what="the router's scrapes see both pods idle")
    for prompt, want in zip(prompts, wants, strict=True):
        assert via.completions.create(model=model, prompt=prompt, **GREEDY).choices[0].text == want
        streamed = "".join(c.choices[0].text for c in
                           via.completions.create(model=model, prompt=prompt, stream=True, **GREEDY) if c.choices)
        assert streamed == want
    assert via.chat.completions.create(model=model, messages=messages, **GREEDY).choices[0].message.content == want_chat
    chunks = via.chat.completions.create(model=model, messages=messages, stream=True, **GREEDY)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want_chat
    # both pods took a share (idle pods take turns), and every answer was counted
    assert all(routed(router, p) >= 1 for p in pods)
    assert sum(routed(router, p) for p in pods) == 7  # /v1/models once, 4 completions, 2 chats


def test_a_pods_error_passes_through_unchanged(pods, router):
    body = {"model": "m", "prompt": "hi", "max_tokens": -1}
    direct = httpx.post(pods[0] + "/v1/completions", json=body)
    via = httpx.post(router + "/v1/completions", json=body)
    assert via.status_code == direct.status_code == 400
    assert via.json() == direct.json()
    assert httpx.get(router + "/nowhere").status_code == 404


def test_least_load_avoids_a_pod_with_queued_work(pods, router):
    """Requests queued on pod 0 by another client (the router never saw them) show in its scrape; the
    router's traffic goes to pod 1 until they are done."""
    busy, other = pods
    long = {"model": "m", "prompt": "x", "max_tokens": 300, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        backlog = [pool.submit(httpx.post, busy + "/v1/completions", json=long, timeout=120) for _ in range(3)]
        wait_until(lambda: router_gauge(router, "iterserve:router_pod_waiting", busy) >= 1, timeout=30,
                   what="the router to scrape pod 0's queue", interval=0.02)
        before = routed(router, busy), routed(router, other)
        client = _client(router)
        for _ in range(4):
            assert client.completions.create(model="m", prompt="short", max_tokens=2).choices[0].text is not None
        assert all(f.result().status_code == 200 for f in backlog)
    assert routed(router, busy) == before[0]
    assert routed(router, other) == before[1] + 4


def test_least_load_weighs_the_prefill_ahead_above_a_request_count(pods, router):
    """Pod 0 runs long generations with a 400-token prompt queued behind them; pod 1 runs as many with two
    one-token prompts queued (sent straight to the pods: the router sees them only in its scrapes). Pod 1
    has more requests, pod 0 more work ahead of a new prompt's first token: the new prompt goes to pod 1."""
    busy, other = pods
    generation = {"model": "m", "prompt": [5], "max_tokens": 480, "ignore_eos": True}

    def queued(prompt: list[int]) -> dict:
        return {"model": "m", "prompt": prompt, "max_tokens": 1}

    def on(pod: str, name: str) -> float:
        return metric_value(httpx.get(pod + "/metrics").text, name)

    # three generations a pod, one after another: one alone may end (a second or less) before the router's
    # next scrape, and the prompts queued behind it would then be prefilled unseen
    client, before = _client(router), (routed(router, busy), routed(router, other))
    with concurrent.futures.ThreadPoolExecutor(9) as pool:
        held = [pool.submit(httpx.post, pod + "/v1/completions", json=generation, timeout=120) for pod in pods]
        wait_until(lambda: all(on(p, "vllm:num_requests_running") == 1 for p in pods), timeout=30,
                   what="both generations running", interval=0.02)
        held += [pool.submit(httpx.post, pod + "/v1/completions", json=generation, timeout=120)
                 for pod in pods for _ in range(2)]
        wait_until(lambda: all(on(p, "vllm:num_requests_waiting") == 2 for p in pods), timeout=30,
                   what="two generations queued on each pod", interval=0.02)
        held += [pool.submit(httpx.post, busy + "/v1/completions", json=queued([7] * 400), timeout=120)]
        held += [pool.submit(httpx.post, other + "/v1/completions", json=queued([9]), timeout=120)
                 for _ in range(2)]

        def premise() -> bool:  # as the router sees the pods: pod 1 more requests, pod 0 more prefill ahead
            waiting = [router_gauge(router, "iterserve:router_pod_waiting", p) for p in pods]
            return (router_gauge(router, "iterserve:router_pod_prefill_ahead_tokens", busy) >= 400
                    and waiting[1] > waiting[0])

        wait_until(premise, timeout=30, what="the router to scrape both queues", interval=0.02)
        assert client.completions.create(model="m", prompt="short", max_tokens=2).choices
        assert all(f.result().status_code == 200 for f in held)
    assert (routed(router, busy), routed(router, other)) == (before[0], before[1] + 1)


def test_least_load_counts_its_own_requests_in_flight(pods, router):
    """A stream the router is relaying makes its pod the busier one at once, before any scrape."""
    client = _client(router)
    stream = client.completions.create(model="m", prompt="a", max_tokens=480, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))
    counts = {p: routed(router, p) for p in pods}
    holder = next(p for p in pods if router_gauge(router, "iterserve:router_pod_in_flight", p) == 1)
    for _ in range(3):
        client.completions.create(model="m", prompt="b", max_tokens=2)
    assert {p: routed(router, p) - counts[p] for p in pods} == {p: 0 if p == holder else 3 for p in pods}
    stream.close()


def test_prefix_hash_keeps_a_prefix_on_one_pod(pods):
    proc, router = start_router(*pods, policy="prefix-hash", extra=("--prefix-chars", "40"))
    try:
        wait_healthy(router, *pods)
        client = _client(router)
        system = "You are a terse assistant for the router test. " * 4
        for i in range(6):
            client.chat.completions.create(model="m", max_tokens=2, messages=[
                {"role": "system", "content": system}, {"role": "user", "content": f"question {i}"}])
        counts = sorted(routed(router, p) for p in pods)
        assert counts == [0, 6]  # one at a time: never over the bound, always the prefix's own pod
        for i in range(20):  # distinct prefixes spread over both pods
            client.completions.create(model="m", prompt=f"{i} distinct prompt", max_tokens=1)
        assert min(routed(router, p) for p in pods) >= 1
        text = httpx.get(router + "/metrics").text
        assert 'iterserve:router_decisions_total{outcome="primary",policy="prefix-hash"} 26.0' in text
    finally:
        stop(proc)


def test_a_client_that_leaves_aborts_its_request_on_the_pod(pods, router):
    def aborted():
        return sum(metric_value(httpx.get(p + "/metrics").text, "vllm:request_success_total",
                                finished_reason="abort") for p in pods)

    before = aborted()

    async def leave_early():
        async with httpx.AsyncClient(timeout=60) as client:
            body = {"model": "m", "prompt": "a", "max_tokens": 480, "ignore_eos": True, "stream": True}
            async with client.stream("POST", router + "/v1/completions", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data:"):
                        break  # one event, then hang up

    asyncio.run(leave_early())
    wait_until(lambda: aborted() == before + 1, timeout=30, what="the pod to abort the request")
    for pod in pods:
        wait_idle(pod, timeout=30)
    wait_until(lambda: all(router_gauge(router, "iterserve:router_pod_in_flight", p) == 0 for p in pods),
               timeout=10, what="the router's in-flight counts to return to 0")


def test_no_routable_pod_is_a_clear_503():
    proc, router = start_router("http://127.0.0.1:9")  # nothing listens on the discard port
    try:
        assert httpx.get(router + "/ready").status_code == 503
        r = httpx.post(router + "/v1/completions", json={"model": "m", "prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_pods"
        assert httpx.get(router + "/health").json()["healthy"] == 0
    finally:
        stop(proc)


def test_a_pod_killed_mid_run_sends_requests_to_the_other(serve_args):
    victim, survivor = start_pods(2, *serve_args)
    proc, router = start_router(victim[1], survivor[1])
    try:
        wait_healthy(router, victim[1], survivor[1])
        client = _client(router)

        def one(i):
            return client.completions.create(model="m", prompt=f"request {i}", max_tokens=40,
                                             extra_body={"ignore_eos": True}).usage.completion_tokens

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            results = [pool.submit(one, i) for i in range(24)]
            wait_until(lambda: routed(router, victim[1]) >= 2, timeout=60, what="pod 0 to answer some requests")
            victim[0].send_signal(signal.SIGKILL)
            assert [f.result() for f in results] == [40] * 24  # none lost: those on the dead pod were retried
        assert router_gauge(router, "iterserve:router_pod_healthy", victim[1]) == 0
        before = routed(router, survivor[1])
        for i in range(4):
            assert one(i) == 40
        assert routed(router, survivor[1]) == before + 4
    finally:
        out = stop(proc)
        for p, _ in (victim, survivor):
            stop(p)
    assert "Traceback" not in out, out


def test_discovery_by_dns_name(pods):
    """--dns-name: every address the name resolves to is a pod on --backend-port (a headless Service's
    ready pods); an address where nothing answers (localhost's ::1 here, if it has one) is skipped."""
    port = pods[0].rsplit(":", 1)[1]
    proc, router = start_router(extra=("--dns-name", "localhost", "--backend-port", port))
    try:
        wait_healthy(router, pods[0])
        r = _client(router).completions.create(model="m", prompt="hi", **TWO)
        assert r.usage.completion_tokens == 2
        assert routed(router, pods[0]) == 1
    finally:
        stop(proc)


def test_a_connection_to_a_pod_outlives_a_pause_in_traffic(pods):
    """The router keeps an idle connection to a pod 60 s, and the pod keeps it 75 s (its default): a
    request after a pause longer than a few seconds takes the same connection instead of opening one."""
    proc, router = start_router(pods[0])
    try:
        wait_healthy(router, pods[0])
        client = _client(router)
        assert client.completions.create(model="m", prompt="before", **TWO).usage.completion_tokens == 2
        time.sleep(6)  # longer than the pods' former 5 s keep-alive and the router's former 3 s pool
        assert client.completions.create(model="m", prompt="after", **TWO).usage.completion_tokens == 2
        text = httpx.get(router + "/metrics").text
        assert metric_value(text, "iterserve:router_upstream_connections_total", pod=pods[0]) == 1
        assert routed(router, pods[0]) == 2
    finally:
        out = stop(proc)
    assert "Traceback" not in out, out


def _spawned_workers(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        kids = [int(k) for k in f.read().split()]
    out = []
    for kid in kids:
        with open(f"/proc/{kid}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():  # not multiprocessing's resource tracker
                out.append(kid)
    return out


def test_workers_share_the_port_and_stop_together(pods):
    """--workers 2: two router processes on one port (SO_REUSEPORT) answer, and SIGTERM to the parent
    stops both."""
    proc, router = start_router(*pods, extra=("--workers", "2"))
    try:
        workers = _spawned_workers(proc.pid)
        assert len(workers) == 2
        wait_healthy(router, *pods)
        for i in range(6):  # new connections each time: the kernel spreads them over the workers
            with _client(router) as fresh:
                assert fresh.completions.create(model="m", prompt=f"w{i}", **TWO).usage.completion_tokens == 2
    finally:
        out = stop(proc)
    assert proc.returncode == 0 and "Traceback" not in out, out
    wait_until(lambda: not any(os.path.exists(f"/proc/{w}") for w in workers), timeout=10,
               what="the workers to exit")


def test_a_pod_that_dies_mid_stream_cuts_the_clients_stream(serve_args):
    """Once a stream has started, the pod's death reaches the client as a broken stream (no terminating
    chunk), never as a short stream that looks whole."""
    (pod, url), = start_pods(1, *serve_args)
    proc, router = start_router(url)
    try:
        wait_healthy(router, url)
        body = {"model": "m", "prompt": "a", "max_tokens": 480, "ignore_eos": True, "stream": True}
        events = 0
        # httpx raises RemoteProtocolError when a chunked body ends without its terminating chunk
        with (pytest.raises(httpx.RemoteProtocolError),
              httpx.stream("POST", router + "/v1/completions", json=body, timeout=60) as r):
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data:"):
                    events += 1
                    if events == 2:
                        pod.send_signal(signal.SIGKILL)
                    assert line != "data: [DONE]"
        assert events < 480
        failures = "iterserve:router_upstream_failures_total"
        wait_until(lambda: metric_value(httpx.get(router + "/metrics").text, failures, pod=url,
                                        reason="mid_response") == 1, timeout=10, what="the router to count it")
    finally:
        out = stop(proc)
        stop(pod)
    assert "Traceback" not in out, out


def test_sigterm_lets_a_stream_in_flight_finish_and_refuses_new_connections(pods):
    """A router pod being replaced: the stream it relays runs to its end within --drain-timeout, while
    no new connection is taken, then the router exits 0."""
    proc, router = start_router(*pods, extra=("--drain-timeout", "60"))
    try:
        wait_healthy(router, *pods)
        body = {"model": "m", "prompt": "a", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=120) as client, client.stream("POST", router + "/v1/completions",
                                                                json=body) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            proc.send_signal(signal.SIGTERM)
            wait_until(lambda: _refused(router), timeout=10, what="the router to stop taking connections")
            events = [line for line in lines if line.startswith("data:")]
        assert events[-1] == "data: [DONE]" and '"finish_reason":"length"' in events[-2].replace(" ", "")
        assert proc.wait(30) == 0
    finally:
        stop(proc)


def _refused(url: str) -> bool:
    try:
        httpx.get(url + "/health", timeout=1)
    except httpx.ConnectError:
        return True
    return False
