"""benchmarks/fleet_sim.py: the least-load routing behaves as the router's policy does in the fluid limit,
round-robin with the operator's rotation sends a backlogged pod nothing until it has drained to its
peers' level (without rotation, its share), and the fleet's p99 pools the pods' latencies as summed
histograms do (tables and properties)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.fleet_sim import FleetSim, even, in_rotation, least_load, merged_p99
from iterserve.common.wire import Knobs
from iterserve.operator.tuning.rotation import rotation_gap

KNOBS = Knobs(max_num_seqs=16, max_num_batched_tokens=512, prefill_chunk_size=128)


@pytest.mark.parametrize("backlogs, rate, expected", [
    ([0, 0, 0, 0], 36.0, [9, 9, 9, 9]),  # no queues: an even share
    ([2182, 0, 0, 0], 36.0, [0, 12, 12, 12]),  # the longest queue takes nothing while it drains
    ([300, 0], 15.0, [5, 10]),  # drained after 15 s of 30: a share for the half window left
    ([0, 0], 50.0, [25, 25]),  # the fleet over capacity: the queues grow level
    ([600, 0], 50.0, [15, 35]),  # ... the shorter one first: both end at 15 x 30 = 450 queued
])
def test_least_load_routing_drains_the_longest_queue_first(backlogs, rate, expected):
    rates = least_load(backlogs, capacity=20.0, rate=rate, dt=30.0)
    assert rates == pytest.approx(expected, abs=1e-6)
    assert even(backlogs, 20.0, rate, 30.0) == pytest.approx([rate / len(backlogs)] * len(backlogs))


@settings(max_examples=200, deadline=None)
@given(backlogs=st.lists(st.floats(0, 5000), min_size=1, max_size=40), rate=st.floats(0, 2000),
       capacity=st.floats(0.5, 50))
def test_least_load_routing_sends_every_arrival_and_never_favours_a_longer_queue(backlogs, rate, capacity):
    rates = least_load(backlogs, capacity, rate, 30.0)
    assert sum(rates) == pytest.approx(rate, rel=1e-6, abs=1e-6) and min(rates) >= 0
    by_queue = [r for _, r in sorted(zip(backlogs, rates, strict=True))]
    assert all(b <= a + 1e-6 for a, b in zip(by_queue, by_queue[1:], strict=False))



def test_in_rotation_shares_the_arrivals_among_the_pods_in():
    assert in_rotation([False, True, False, False], 36.0) == [12.0, 0.0, 12.0, 12.0]
    assert in_rotation([False, False], 10.0) == [5.0, 5.0]


def arrivals(sim: FleetSim, rate: float, windows: int, dt: float = 30.0,
             start: float = 0.0) -> list[tuple[list[float], list[float]]]:
    """Per window, each ready pod's backlog at its start and the arrival rate it was sent (the pods'
    model's `window` called with it)."""
    sent: list[float] = []
    for p in sim.pods:
        inner = p.model.window

        def window(knobs, r, start, end, inner=inner):
            sent.append(r)
            return inner(knobs, r, start, end)

        p.model.window = window  # type: ignore[method-assign]
    out = []
    for i in range(windows):
        before = [p.model.backlog for p in sim.pods]
        sent.clear()
        sim.window(KNOBS, rate, start + i * dt, start + (i + 1) * dt)
        out.append((before, list(sent)))
    return out


def test_rotation_takes_a_backlogged_pod_out_of_round_robin_until_it_has_drained():
    sim = FleetSim(4, seed=1, start_s=60)
    capacity = sim.pods[0].model.steady(KNOBS, 0.0).capacity
    rate = 3 * capacity * 0.8  # three pods carry it: the others' queues stay at zero
    sim.pods[0].model.backlog = 3 * capacity * 30.0  # three windows' worth of its capacity
    outs = []
    for i in range(6):
        gap = rotation_gap(sim.per_pod_rate, 30.0)  # what a pod finished in the last window, 4 at least
        [(before, sent)] = arrivals(sim, rate, 1, start=i * 30.0)
        if before[0] > min(before) + gap:  # the product's rule
            assert sent == pytest.approx([0.0, rate / 3, rate / 3, rate / 3])  # out: nothing new
        else:
            assert sent == pytest.approx([rate / 4] * 4)  # in (again): an even share
        outs.append(sent[0] == 0)
    assert outs == [True, True, True, False, False, False]  # out while more than a window's work stands over the rest
    assert sim.out == frozenset()


def test_rotation_leaves_in_a_pod_with_less_than_a_ticks_work_over_the_shortest():
    """Out for a tick, it would run dry and idle while its peers take its share."""
    sim = FleetSim(2, seed=1, start_s=60)
    capacity = sim.pods[0].model.steady(KNOBS, 0.0).capacity
    sim.per_pod_rate = capacity / 2  # the last window's completions per pod: a gap of 15 s of capacity
    sim.pods[0].model.backlog = 10 * capacity
    [(_, sent)] = arrivals(sim, capacity / 2, 1)
    assert sent == pytest.approx([capacity / 4] * 2) and sim.out == frozenset()
    sim.per_pod_rate = capacity / 2
    sim.pods[0].model.backlog = 20 * capacity + sim.pods[1].model.backlog
    [(_, sent)] = arrivals(sim, capacity / 2, 1)
    assert sent == pytest.approx([0.0, capacity / 2]) and sim.out == {sim.pods[0].name}


def test_without_rotation_round_robin_keeps_the_even_split():
    sim = FleetSim(4, seed=1, start_s=60, rotation=False)
    capacity = sim.pods[0].model.steady(KNOBS, 0.0).capacity
    rate = 3 * capacity * 0.8
    sim.pods[0].model.backlog = 3 * capacity * 30.0
    for _, sent in arrivals(sim, rate, 6):
        assert sent == pytest.approx([rate / 4] * 4)
    assert sim.pods[0].model.backlog > 0 and sim.out == frozenset()  # still draining, at what its share leaves


def test_least_load_never_rotates():
    sim = FleetSim(2, seed=1, start_s=60, routing="least-load")
    sim.pods[0].model.backlog = 100.0
    sim.window(KNOBS, 10.0, 0, 30)
    assert not sim.rotation and sim.out == frozenset()


@pytest.mark.parametrize("p99s, weights, expected", [
    ([2.0, 2.0, 2.0], [1, 5, 9], 2.0),  # equal pods: their p99, whatever the weights
    ([1.0, 100.0], [1, 0], 1.0),  # a pod that finished nothing weighs nothing
    ([1.0, 100.0], [3, 1], pytest.approx(69.9, abs=0.1)),  # a quarter of the requests 100x slower: near them
    ([1.0, 100.0], [999, 1], pytest.approx(1.02, abs=0.01)),  # a 0.1% slow share moves the p99 little
    ([1.0, 3.0], [0, 0], 3.0),  # nothing finished anywhere: the worst, not a guess
])
def test_merged_p99_pools_the_pods_tails(p99s, weights, expected):
    assert merged_p99(p99s, weights) == expected


@settings(max_examples=200, deadline=None)
@given(pods=st.lists(st.tuples(st.floats(0.01, 1000), st.floats(0, 1000)), min_size=1, max_size=64))
def test_merged_p99_lies_between_the_pods_p99s(pods):
    p99s, weights = [p for p, _ in pods], [w for _, w in pods]
    assert min(p99s) - 1e-9 <= merged_p99(p99s, weights) <= max(p99s) + 1e-9


def test_the_fleet_p99_is_the_pooled_one_and_the_worst_pods_on_request():
    pooled = FleetSim(32, seed=1, start_s=60).window(KNOBS, 320.0, 0, 30)
    worst = FleetSim(32, seed=1, start_s=60, fleet_p99="worst-pod").window(KNOBS, 320.0, 0, 30)
    assert pooled.request_rate == worst.request_rate and pooled.waiting == worst.waiting  # the same pods
    assert pooled.itl_p99_s < worst.itl_p99_s and pooled.ttft_p99_s < worst.ttft_p99_s  # 32 noisy draws' max
