"""Rotation's decision (operator/tuning/rotation.py): which pods a plain Service leaves out of its rotation,
a table of cases and the invariants over any queues."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from iterserve.operator.tuning.rotation import GAP, out_of_rotation, rotation_active, rotation_gap


@pytest.mark.parametrize("waiting, gap, expected", [
    ({}, GAP, set()),
    ({"a": 90.0}, GAP, set()),  # one pod: it is the Service's only endpoint
    ({"a": 0.0, "b": 0.0, "c": 1.0}, GAP, set()),  # queues level within the gap
    ({"a": 130.0, "b": 0.0, "c": 0.0}, GAP, {"a"}),  # the step's backlog on the pod that took it
    ({"a": 0.0, "b": GAP}, GAP, set()),  # at the gap: in
    ({"a": 0.0, "b": GAP + 0.5}, GAP, {"b"}),  # past it: out
    ({"a": 40.0, "b": 30.0, "c": 3.0, "d": 5.0}, GAP, {"a", "b"}),  # against the shortest, not the mean
    ({"a": 14.0, "b": 0.0}, 18.0, set()),  # less than a tick's work over the shortest: out, it would idle
    ({"a": 130.0, "b": 7.0}, 18.0, {"a"}),
])
def test_out_of_rotation(waiting, gap, expected):
    assert out_of_rotation(waiting, gap) == frozenset(expected)


@pytest.mark.parametrize("per_pod_rate, interval_s, gap", [
    (3.6, 5.0, 18.0),  # the live pods: 3.6 requests/s each, a tick every 5 s
    (20.0, 30.0, 600.0),
    (0.2, 5.0, GAP),  # a quiet fleet: the least gap
    (0.0, 5.0, GAP),  # nothing finished (or not read)
])
def test_the_gap_is_what_a_pod_finishes_in_a_tick(per_pod_rate, interval_s, gap):
    assert rotation_gap(per_pod_rate, interval_s) == pytest.approx(gap)


@pytest.mark.parametrize("mode, router, active", [
    ("auto", False, True), ("auto", True, False), ("observe", False, False), ("off", False, False),
])
def test_rotation_active_only_in_auto_mode_behind_a_plain_service(mode, router, active):
    assert rotation_active(mode, router) is active


queues = st.dictionaries(st.sampled_from("abcdefgh"), st.floats(0, 500, allow_nan=False), max_size=8)


@given(queues, st.floats(GAP, 1000))
def test_a_pod_with_the_shortest_queue_is_always_in_and_only_standing_queues_go_out(waiting, gap):
    chosen = out_of_rotation(waiting, gap)
    assert chosen <= waiting.keys()
    if waiting:
        lo = min(waiting.values())
        assert any(w == lo and pod not in chosen for pod, w in waiting.items())  # the Service has an endpoint
        assert chosen == {pod for pod, w in waiting.items() if w > lo + gap}


@given(queues, st.floats(GAP, 500), st.floats(0, 500))
def test_a_wider_gap_never_takes_more_pods_out(waiting, gap, more):
    assert out_of_rotation(waiting, gap + more) <= out_of_rotation(waiting, gap)
