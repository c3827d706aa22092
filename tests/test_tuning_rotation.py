"""Rotation's decision (operator/tuning/rotation.py): which pods a plain Service leaves out of its rotation,
a table of cases and the invariants over any queues."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from iterserve.operator.tuning.rotation import GAP, out_of_rotation, rotation_active


@pytest.mark.parametrize("waiting, out, expected", [
    ({}, set(), set()),
    ({"a": 90.0}, set(), set()),  # one pod: it is the Service's only endpoint
    ({"a": 0.0, "b": 0.0, "c": 1.0}, set(), set()),  # queues level within the gap
    ({"a": 130.0, "b": 0.0, "c": 0.0}, set(), {"a"}),  # the step's backlog on the pod that took it
    ({"a": 0.0, "b": GAP}, set(), set()),  # at the gap: in
    ({"a": 0.0, "b": GAP + 0.5}, set(), {"b"}),  # past it: out
    ({"a": 1.0, "b": 1.0 + GAP / 2 + 0.5}, {"b"}, {"b"}),  # out, and not yet within half the gap: stays out
    ({"a": 1.0, "b": 1.0 + GAP / 2}, {"b"}, set()),  # within half the gap: back in
    ({"a": 40.0, "b": 30.0, "c": 3.0, "d": 5.0}, set(), {"a", "b"}),  # against the shortest, not the mean
    ({"a": 6.0, "b": 6.0}, {"a", "b"}, set()),  # all out (a stale view) and level: all back
    ({"a": 50.0, "b": 20.0}, {"b"}, {"a"}),  # the shortest is in whatever it was
])
def test_out_of_rotation(waiting, out, expected):
    assert out_of_rotation(waiting, out) == frozenset(expected)


@pytest.mark.parametrize("mode, router, active", [
    ("auto", False, True), ("auto", True, False), ("observe", False, False), ("off", False, False),
])
def test_rotation_active_only_in_auto_mode_behind_a_plain_service(mode, router, active):
    assert rotation_active(mode, router) is active


queues = st.dictionaries(st.sampled_from("abcdefgh"), st.floats(0, 500, allow_nan=False), max_size=8)


@given(queues, st.sets(st.sampled_from("abcdefgh")))
def test_a_pod_with_the_shortest_queue_is_always_in_and_only_standing_queues_go_out(waiting, out):
    chosen = out_of_rotation(waiting, out)
    assert chosen <= waiting.keys()
    if waiting:
        lo = min(waiting.values())
        assert any(w == lo and pod not in chosen for pod, w in waiting.items())  # the Service has an endpoint
        assert all(waiting[pod] > lo + GAP / 2 for pod in chosen)
        assert all(pod in chosen for pod, w in waiting.items() if w > lo + GAP)


@given(queues, st.sets(st.sampled_from("abcdefgh")))
def test_a_pod_out_stays_out_at_least_as_long_as_one_in_would_go_out(waiting, out):
    """Hysteresis: being out never makes a pod come back sooner than being in would keep it."""
    assert out_of_rotation(waiting, set()) <= out_of_rotation(waiting, out | set(waiting))
