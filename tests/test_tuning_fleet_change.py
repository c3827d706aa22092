"""While pods a scale-out added come up and their backlog drains, the tuner does not back max_num_seqs off
for a breach, and once they are up (settling or draining), or ITL is over as well, it does not raise the
chunk either:
`scale_out_in_flight` on a table of scaler states, then `decide` with and without a scale-out in flight on
the same windows (the held move gives way to the next cure, or to holding; preemptions still back off;
ITL's breach is still cured); `second_look` at a move on the window the scaler grows the fleet on (the
scaler's own `decide_scale` on the tuner's record); `OutsideScale` following a fleet sized outside the
operator tick by tick."""

from __future__ import annotations

import dataclasses

import pytest

from iterserve.operator.autoscaling import fleet_of
from iterserve.operator.tuning.decide import (
    BACK_OFF_SEQS,
    HOLD,
    LOWER_CHUNK,
    RAISE_CHUNK,
    RAISE_SEQS,
    ROLLBACK,
    TunerState,
    decide,
)
from iterserve.operator.tuning.fleet_change import OutsideScale, ScaleOut, scale_out_in_flight, second_look, told
from iterserve.operator.tuning.scale import decide_scale
from iterserve.operator.tuning.scale_state import SCALE_IN, SCALE_OUT, ScalePolicy, ScaleState
from iterserve.operator.tuning.tuner import TuningRecord
from tests.tuning_windows import ITL_OVER, START, TTFT_OVER_NO_QUEUE, TTFT_OVER_QUEUED, window
from tests.tuning_windows import POLICY as TUNING

POLICY = ScalePolicy(min_replicas=1, max_replicas=8, settle_s=60, pod_start_s=600)
NOW = 10_000.0
OUT = ScaleState(last_scale_time=NOW - 20, last_direction=SCALE_OUT, starting=True)

SETTLED = dataclasses.replace(OUT, last_scale_time=NOW - 100, starting=False, whole_since=NOW - 80)

# title, state, (replicas, ready), requests waiting as the tuner reads them now, words in the reason (None:
# none in flight)
ROWS = [
    ("the autoscaler never moved", ScaleState(), (2, 1), 0.0, None),
    ("pods a scale-out added are starting", OUT, (2, 1), 30.0, "starting (1/2 ready)"),
    ("all ready now, before the scaler has seen it: a window from now", OUT, (2, 2), 30.0, "settling (60 s left)"),
    ("ready 30 s ago: half a window left",
     dataclasses.replace(OUT, last_scale_time=NOW - 45, starting=False, whole_since=NOW - 30), (2, 2), 30.0,
     "(30 s left)"),
    ("ready a window ago, nothing read since the scale-out: over",
     dataclasses.replace(OUT, last_scale_time=NOW - 100, starting=False, whole_since=NOW - 60), (2, 2), 30.0, None),
    ("pods that never started are not waited for past pod_start_s",
     dataclasses.replace(OUT, last_scale_time=NOW - 600), (2, 1), 30.0, None),
    ("settled, the queue still falling: the backlog drains",
     dataclasses.replace(SETTLED, queue_before=(NOW - 10, 44.0), last_queue=(NOW - 5, 40.0)), (2, 2), 36.0,
     "draining the backlog (40 -> 36 waiting)"),
    # a live run: the scaler's readings, a tick older than the tuner's, had the queue still rising
    ("settled, the queue falling only as the tuner reads it now: the backlog drains",
     dataclasses.replace(SETTLED, queue_before=(NOW - 10, 21.7), last_queue=(NOW - 5, 22.0)), (2, 2), 18.1,
     "draining the backlog (22 -> 18 waiting)"),
    ("settled, the queue rising again as the tuner reads it now: an overload of the new fleet",
     dataclasses.replace(SETTLED, queue_before=(NOW - 10, 40.0), last_queue=(NOW - 5, 36.0)), (2, 2), 38.0, None),
    ("settled, the backlog gone (under one request waiting)",
     dataclasses.replace(SETTLED, queue_before=(NOW - 10, 5.0), last_queue=(NOW - 5, 3.0)), (2, 2), 0.8, None),
    ("readings from before the scale-out say nothing of its backlog",
     dataclasses.replace(SETTLED, queue_before=(NOW - 110, 40.0), last_queue=(NOW - 105, 36.0)), (2, 2), 30.0, None),
    ("a scale-in is not a scale-out", ScaleState(last_scale_time=NOW - 10, last_direction=SCALE_IN), (1, 1), 0.0,
     None),
]


@pytest.mark.parametrize("title, state, seen, queued, words", ROWS, ids=[r[0] for r in ROWS])
def test_scale_out_in_flight(title, state, seen, queued, words):
    why = told(scale_out_in_flight(state, *seen, POLICY, NOW), queued)
    assert why is None if words is None else (why is not None and words in str(why)), why
    assert why is None or why.ready == ("starting" not in words)  # pods up: a larger chunk is held


IN_FLIGHT = ScaleOut("pods the autoscaler added are starting (1/2 ready)")
DRAINING = ScaleOut("the 2 replicas the autoscaler grew to are draining the backlog (34 -> 6 waiting)", ready=True)
SETTLING = ScaleOut("the 2 replicas the autoscaler grew to are settling (55 s left)", ready=True)


def decide_at(obs, scale_out, knobs=START, confirmed=False):
    """`confirmed`: both p99s were over in earlier windows (a breach now is confirmed, however mild)."""
    state = TunerState(knobs)
    if confirmed:
        before = NOW - 2 * TUNING.window_s
        state = dataclasses.replace(state, num_ttft_breaches=3, ttft_breach_end=before, num_itl_breaches=3,
                                    itl_breach_end=before)
    return decide(state, dataclasses.replace(obs, start=NOW - TUNING.window_s, end=NOW), TUNING, NOW, scale_out)


@pytest.mark.parametrize("name, obs, knobs, held_action", [
    # both far over, nothing waiting for a place: a back-off first, then a smaller chunk
    ("the back-off gives way to a smaller chunk", window(ttft=3000, itl=400), START, LOWER_CHUNK),
    ("the chunk at its bound: the knobs hold", window(ttft=3000, itl=400), START.replace(prefill_chunk_size=32),
     HOLD),
])
def test_no_back_off_while_a_scale_out_is_in_flight(name, obs, knobs, held_action):
    assert decide_at(obs, None, knobs).action == BACK_OFF_SEQS
    held = decide_at(obs, IN_FLIGHT, knobs)
    assert held.action == held_action and held.state.knobs.max_num_seqs == knobs.max_num_seqs, held.reason
    if held_action == LOWER_CHUNK:
        assert "not backing max_num_seqs off" in held.reason and str(IN_FLIGHT) in held.reason
    if held_action == HOLD:
        assert str(IN_FLIGHT) in held.reason and held.tuned.status == "False" and held.state.last_change_time is None


def test_other_cures_and_preemptions_are_not_held():
    ttft = window(ttft=3000, itl=40, waiting=3)  # TTFT over, the cap binding: more places
    assert decide_at(ttft, IN_FLIGHT).action == decide_at(ttft, None).action != BACK_OFF_SEQS
    preempted = decide_at(window(waiting=3, preempt=2.0), IN_FLIGHT)
    assert preempted.action == BACK_OFF_SEQS and preempted.state.knobs.max_num_seqs < START.max_num_seqs


def test_a_raise_of_max_num_seqs_is_not_rolled_back_while_a_scale_out_starts():
    """The tuner's raise and the autoscaler's scale-out in one tick: the next window shows the new pod's start
    (p99 TTFT worse, no more throughput), and going back to fewer places there is a back-off (a live test's
    two pods then sat at max_num_seqs 1 over their SLO). Without a scale-out it is rolled back as before."""
    raised = decide_at(window(ttft=3000, itl=40, waiting=3), None)
    assert raised.action == RAISE_SEQS and raised.state.pending is not None
    later = NOW + TUNING.window_s
    worse = dataclasses.replace(window(ttft=4000, itl=40, waiting=4), start=NOW, end=later)
    assert decide(raised.state, worse, TUNING, later, None).action == ROLLBACK
    held = decide(raised.state, worse, TUNING, later, IN_FLIGHT)
    assert held.action == HOLD and str(IN_FLIGHT) in held.reason, held.reason
    assert held.state.knobs == raised.state.knobs and held.state.pending == raised.state.pending
    preempted = dataclasses.replace(window(ttft=4000, itl=40, waiting=4, preempt=2.0), start=NOW, end=later)
    assert decide(raised.state, preempted, TUNING, later, IN_FLIGHT).action == ROLLBACK  # the KV cannot wait


@pytest.mark.parametrize("up", [SETTLING, DRAINING], ids=["settling", "draining"])
@pytest.mark.parametrize("name, obs, knobs, drained_action", [
    ("TTFT over, requests waiting for places: more places still", TTFT_OVER_QUEUED, START, RAISE_SEQS),
    ("TTFT over, nothing waiting for places: a larger chunk, held", TTFT_OVER_NO_QUEUE, START, HOLD),
    ("TTFT severe, nothing waiting for places: a larger chunk, held", window(ttft=3000, itl=40), START, HOLD),
    # a live run's window: ITL cured with chunk 64 as the pod started, then TTFT 3.1x with ITL under its
    # SLO in the settling window raised it to 256, and the next window breached ITL
    ("ITL cured by a smaller chunk, then TTFT severe: the cure is not undone",
     window(ttft=3000, itl=40), START.replace(prefill_chunk_size=64), HOLD),
])
def test_once_the_pods_are_up_ttft_is_not_cured_by_a_larger_chunk(up, name, obs, knobs, drained_action):
    # the same window's cure with no scale-out, and while the pods start (the backlog still grows)
    cured = decide_at(obs, None, knobs, confirmed=True)
    assert cured.action in (RAISE_SEQS, RAISE_CHUNK) and decide_at(obs, IN_FLIGHT, knobs, confirmed=True) == cured
    drained = decide_at(obs, up, knobs, confirmed=True)
    assert drained.action == drained_action, drained.reason
    if drained_action == RAISE_SEQS:
        assert drained.state.knobs == cured.state.knobs
    else:
        assert drained.state.knobs == knobs and drained.state.last_change_time is None
        assert str(up) in drained.reason and "not raising the chunk" in drained.reason
        assert drained.tuned.status == "False"  # the SLO is breached all the same, and said so


@pytest.mark.parametrize("up", [SETTLING, DRAINING], ids=["settling", "draining"])
def test_once_the_pods_are_up_itl_is_still_cured(up):
    itl = decide_at(ITL_OVER, up, confirmed=True)
    assert itl.action == decide_at(ITL_OVER, None, confirmed=True).action == LOWER_CHUNK
    # both severe, TTFT the farther, a new queue: with no scale-out its TTFT is cured first (a larger chunk);
    # once the pods are up ITL's cure is next, a smaller chunk (and no back-off)
    both = window(ttft=3000, itl=160)
    assert decide_at(both, None).action == RAISE_CHUNK
    drained = decide_at(both, up)
    assert drained.action == LOWER_CHUNK and drained.state.knobs.max_num_seqs == START.max_num_seqs


@pytest.mark.parametrize("name, obs, knobs, held_action", [
    # the live runs' window: a second pod starting, the queue new and TTFT the farther over, ITL over too
    ("a smaller chunk for ITL instead", window(ttft=3000, itl=160), START, LOWER_CHUNK),
    ("the chunk at its lower bound: the knobs hold", window(ttft=3000, itl=160),
     START.replace(prefill_chunk_size=32), HOLD),
])
def test_while_pods_start_with_itl_over_the_chunk_is_not_raised(name, obs, knobs, held_action):
    assert decide_at(obs, None, knobs).action == RAISE_CHUNK
    held = decide_at(obs, IN_FLIGHT, knobs)
    assert held.action == held_action, held.reason
    assert held.state.knobs.prefill_chunk_size <= knobs.prefill_chunk_size
    assert held.state.knobs.max_num_seqs == knobs.max_num_seqs  # and no back-off
    assert str(IN_FLIGHT) in held.reason and "not raising the chunk" in held.reason, held.reason
    # ITL within its SLO: the larger chunk is TTFT's cure while the pods start as before
    ttft = window(ttft=3000, itl=40)
    assert decide_at(ttft, IN_FLIGHT, knobs).action == decide_at(ttft, None, knobs).action == RAISE_CHUNK


# a live window: a new queue, p99 TTFT 1.51x and ITL 1.13x, the cap not binding: the tuner raised the chunk
# 128 -> 256, and the scaler then grew the fleet on it for the growing queue (ITL went to 445-486 ms)
GROWING = dataclasses.replace(window(ttft=1510, itl=113, waiting=8, running=2), start=NOW - TUNING.window_s, end=NOW)
GREW = ScaleState(queue=((NOW - TUNING.window_s, 2.0),))  # the window before it: 2 waiting, now 8
SCALER = ScalePolicy(min_replicas=1, max_replicas=2, settle_s=TUNING.window_s, window_s=TUNING.window_s)


def scaler_on(state: ScaleState, replicas: int = 1):
    """The scaler's decision on a tuner's decision, as the operator asks it (`scales_out`)."""
    def scales_out(d) -> bool:
        record = TuningRecord("team-a", "chat", NOW, d.state.knobs, GROWING, d, d.applied)
        fleet = fleet_of(record, TUNING, replicas, replicas, ())
        return decide_scale(state, fleet, SCALER, NOW).action == SCALE_OUT
    return scales_out


def look(scale_out, scales_out):
    first = decide_at(GROWING, scale_out)
    return first, second_look(first, scale_out, GROWING.queued, lambda again: decide_at(GROWING, again), scales_out)


def test_a_raise_on_the_window_the_fleet_grows_on_is_held():
    first, looked = look(None, scaler_on(GREW))
    assert first.action == RAISE_CHUNK and first.state.knobs.prefill_chunk_size == 256
    assert looked.action == HOLD and looked.state.knobs == START and looked.state.last_change_time is None
    assert "adds on this window are about to start: not raising the chunk" in looked.reason, looked.reason
    assert scaler_on(GREW)(looked)  # the growth rule reads the queue: the fleet grows on the hold as well


def test_a_drain_the_window_resolves_away_gets_a_second_look():
    """A drain the tuner's window resolves away (the queue grows again) told the tuner nothing: the move is
    looked at again."""
    drain = ScaleOut("the 2 replicas the autoscaler grew to are draining the backlog", ready=True, drain_from=5.0)
    assert drain.seen(GROWING.queued) is None
    first, looked = look(drain, scaler_on(GREW))
    assert first.action == RAISE_CHUNK and looked.action == HOLD


def never(d):
    raise AssertionError("the scaler is not asked")


@pytest.mark.parametrize("name, scale_out, scales_out", [
    ("the queue not growing: no scale-out, the raise stands", None, scaler_on(ScaleState())),
    ("at maxReplicas: no scale-out, the raise stands", None, scaler_on(GREW, replicas=2)),
    ("the fleet would not grow on the held decision: the raise stands", None, lambda d: d.action == RAISE_CHUNK),
    ("a scale-out in flight: the tuner was told of it, the scaler is not asked", IN_FLIGHT, never),
])
def test_the_move_stands(name, scale_out, scales_out):
    first, looked = look(scale_out, scales_out)
    assert looked == first


def test_a_hold_is_not_looked_at_again():
    held = decide_at(window(), None)
    assert held.action == HOLD and second_look(held, None, 0.0, never, never) == held


def follow(ticks: list[tuple[int, int, float | None]], window_s: float = 60.0) -> list[str | None]:
    """`OutsideScale` over ticks 5 s apart of (spec.replicas, pods ready, requests waiting as the tuner reads
    them at the tick and the scaler records after it): what each tick tells the tuner."""
    outside, said = OutsideScale(), []
    for i, (replicas, ready, queued) in enumerate(ticks):
        now = NOW + 5 * i
        outside = outside.see(replicas, ready, now)
        why = outside.in_flight(ready, window_s, now)
        why = why if why is None or queued is None else why.seen(queued)  # the tuner reads `queued` now
        said.append(None if why is None else str(why))
        if queued is not None:
            outside = outside.queue(queued, now)
    return said


def test_an_outside_scale_out_is_followed_from_start_through_the_drain():
    said = follow([(1, 1, 30.0), (2, 1, 34.0), (2, 1, 38.0), (2, 2, 40.0)]  # an HPA's second pod starts
                  + [(2, 2, 40.0 - 2 * i) for i in range(12)]  # a window of settling, the backlog falling
                  + [(2, 2, 8.0), (2, 2, 9.0), (2, 2, 10.0)])  # the queue grows again: an overload, not held
    assert said[0] is None  # the first count seen is no change
    assert said[1] == said[2] == "pods added outside the operator are starting (1/2 ready)"
    assert said[3] == "the 2 replicas the fleet grew to outside the operator are settling (60 s left)"
    assert "settling (5 s left)" in said[14] and "draining the backlog (20 -> 18 waiting)" in said[15]
    assert "(18 -> 8 waiting)" in said[-3] and said[-2:] == [None, None]  # 8 -> 9: the queue grows, not held


@pytest.mark.parametrize("name, ticks", [
    ("a fleet that never changes", [(2, 2, 40.0)] * 4),
    ("a scale-in", [(3, 3, 0.0), (2, 3, 0.0), (2, 2, 0.0)]),
    ("a pod that is not ready, with no change of count", [(2, 2, 0.0), (2, 1, 0.0), (2, 1, 0.0)]),
])
def test_no_scale_out_no_hold(name, ticks):
    assert follow(ticks) == [None] * len(ticks)


def test_an_outside_scale_out_whose_pods_never_start_is_not_waited_for():
    said = follow([(1, 1, None), (2, 1, None)] + [(2, 1, None)] * 119 + [(2, 1, None)])
    assert said[1] is not None and said[-2] is not None and said[-1] is None  # 600 s on
