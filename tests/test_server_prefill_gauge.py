"""`iterserve:num_prompt_tokens_pending`, the prefill ahead of a new prompt that the router's least-load
reads: the prompt tokens of requests in flight that have no output yet, on the real server. The engine
core runs in this process with its model runner held at a gate, so the requests stay unprefilled for as
long as the test looks, whatever this machine's speed."""

from __future__ import annotations

import threading

import httpx

from iterserve.common import wire
from tests.server_support import InProcessServer, metric_value
from tests.waiting import wait_until

MODEL = "m"


class _GatedRunner:
    """The real model runner, running a step only while `gate` is open."""

    def __init__(self, runner, gate: threading.Event):
        self.runner, self.gate = runner, gate

    def execute_model(self, out):
        self.gate.wait()
        return self.runner.execute_model(out)

    def __getattr__(self, name):
        return getattr(self.runner, name)


def pending(url: str) -> float:
    return metric_value(httpx.get(url + "/metrics", timeout=10).text, wire.PROMPT_TOKENS_PENDING)


def test_prompt_tokens_pending_counts_prompts_until_their_first_output(tiny_dir):
    gate = threading.Event()
    with InProcessServer(tiny_dir, model_name=MODEL, core_in_process=True) as srv:
        assert pending(srv.url) == 0
        srv.core.model_runner = _GatedRunner(srv.core.model_runner, gate)
        answers: list[httpx.Response] = []

        def send(prompt: list[int], stream: bool) -> None:
            answers.append(httpx.post(srv.url + "/v1/completions", timeout=120, json={
                "model": MODEL, "prompt": prompt, "max_tokens": 3, "ignore_eos": True, "stream": stream}))

        clients = [threading.Thread(target=send, args=([7] * 40, False)),
                   threading.Thread(target=send, args=([9] * 25, True))]
        for client in clients:
            client.start()
        # both held before their prefill: every prompt token is still ahead of a new prompt
        wait_until(lambda: pending(srv.url) == 65, timeout=60, what="both prompts counted as pending")
        assert srv.engine.num_in_flight == 2
        gate.set()
        for client in clients:
            client.join(120)
        assert [a.status_code for a in answers] == [200, 200]
        assert pending(srv.url) == 0  # prefilled (and finished): nothing ahead any more
