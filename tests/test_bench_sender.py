"""The load loop through its `RequestSender` seam (bench/load.py), without a server: a recording sender
stands in for the HTTP one, so what the loop itself decides (how many requests are in flight, which
requests go, what a stop does) is checked on its own. The HTTP sender is driven against a real server in
test_bench_serve.py."""

from __future__ import annotations

import asyncio
import threading

from hypothesis import given, settings
from hypothesis import strategies as st

from iterserve.bench.client import RequestRecord, Target
from iterserve.bench.load import BenchConfig, RequestSender, run_bench
from iterserve.bench.workload import RequestSpec, WorkloadSpec, parse_length
from tests.server_support import free_port


class RecordingSender:
    """A `RequestSender` that answers every request itself after `hold_s` (or, with `gate`, once the
    gate opens), counting what is in flight; `on_send(n)` runs as the n-th request starts."""

    def __init__(self, hold_s: float = 0.002, gate: asyncio.Event | None = None, on_send=None):
        self.hold_s, self.gate, self.on_send = hold_s, gate, on_send
        self.sent: list[int] = []  # request indexes, in the order they went
        self.in_flight = self.max_in_flight = 0
        self.probes = 0

    async def models(self, url: str, api_key: str | None) -> list[dict]:
        return [{"id": "recorded", "max_model_len": 512}]

    async def probe(self, target: Target, spec: RequestSpec) -> Target:
        self.probes += 1
        return target

    async def send(self, target: Target, spec: RequestSpec, record: RequestRecord, t0: float,
                   timeout: float) -> None:
        self.sent.append(spec.index)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        if self.on_send is not None:
            self.on_send(len(self.sent))
        try:
            if self.gate is not None:
                await self.gate.wait()
            else:
                await asyncio.sleep(self.hold_s)
            record.status, record.first_token, record.end = 200, record.start, record.start + self.hold_s
            record.chunk_times, record.chunk_tokens, record.output_tokens = [record.start], [1], 1
        except asyncio.CancelledError:
            record.fail("cancelled", "stopped", record.start)
            raise
        finally:
            self.in_flight -= 1


def _config(sender: RequestSender, **load) -> BenchConfig:
    # /metrics on a closed loopback port: the run goes on without server figures
    return BenchConfig(url=f"http://127.0.0.1:{free_port()}", sender=sender,
                       workload=WorkloadSpec("random", input_len=parse_length("8"), output_len=parse_length("4")),
                       **load)


@settings(max_examples=15, deadline=None)
@given(concurrency=st.integers(1, 6), num_requests=st.integers(1, 20))
def test_closed_loop_keeps_exactly_concurrency_requests_in_flight(concurrency, num_requests):
    sender = RecordingSender()
    result = run_bench(_config(sender, concurrency=concurrency, num_requests=num_requests))
    run = result.runs[0]
    assert sender.probes == 1
    assert sorted(sender.sent) == list(range(num_requests))  # each request of the workload once
    assert sender.max_in_flight == min(concurrency, num_requests)
    assert [r.status for r in run.records] == [200] * num_requests and not run.interrupted
    assert result.server["model"] == "recorded" and result.server["metrics"] is False
    assert result.config["sender"] == "RecordingSender"


def test_an_unbounded_open_loop_sends_everything_at_once():
    sender = RecordingSender(hold_s=0.05)
    run_bench(_config(sender, rate=float("inf"), num_requests=12))
    assert sender.max_in_flight == 12


def test_stop_sends_nothing_more_and_records_the_requests_in_flight_as_cancelled():
    stop, gate = threading.Event(), asyncio.Event()  # the gate never opens: only the stop ends the run
    sender = RecordingSender(gate=gate, on_send=lambda n: stop.set() if n == 3 else None)
    result = run_bench(_config(sender, concurrency=3, num_requests=50), stop)
    run = result.runs[0]
    assert sender.sent == [0, 1, 2] and sender.in_flight == 0
    assert [r.error_kind for r in run.records] == ["cancelled"] * 3
    assert run.interrupted and result.interrupted


def test_stop_between_sweep_levels_runs_no_further_level():
    stop = threading.Event()
    sender = RecordingSender(on_send=lambda n: stop.set() if n == 4 else None)
    result = run_bench(_config(sender, concurrency=2, sweep=(2, 4, 8), num_requests=4), stop)
    assert [r.label for r in result.runs] == ["concurrency=2"] and result.interrupted
    assert len(sender.sent) == 4
