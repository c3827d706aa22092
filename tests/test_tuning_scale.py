"""decide_scale() on tables: each row is a fleet (replicas, ready pods, one window, the tuner's verdict)
and a scaler state, and checks the action, the replicas after it, the reason and the Autoscaling
condition. Then a property: whatever it reads, the count stays in the range and moves as documented."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from iterserve.operator.tuning.actions import HOLD, RAISE_SEQS, ROLLBACK
from iterserve.operator.tuning.decision import NOT_OBSERVED, Condition
from iterserve.operator.tuning.observation import Observation
from iterserve.operator.tuning.policy import TuningPolicy
from iterserve.operator.tuning.reading import read
from iterserve.operator.tuning.scale import (
    SCALE_IN,
    SCALE_OUT,
    SCALE_RULES,
    STAY,
    Fleet,
    ScalePolicy,
    ScaleState,
    WindowLoad,
    decide_scale,
)
from iterserve.operator.tuning.scale_tick import Tick

TUNING = TuningPolicy(ttft_p99_ms=1000, itl_p99_ms=100, min_samples=20)
POLICY = ScalePolicy(min_replicas=1, max_replicas=8, scale_up_window_s=0, scale_down_window_s=300, settle_s=60)
NOW = 10_000.0
MET = Condition("True", "SLOMet", "met")
BOUNDS = Condition("False", "BoundsReached", "at the bounds")
NO_BETTER = Condition("False", "NoBetterSetting", "all failed")
BREACHED = Condition("False", "SLOBreached", "correcting")


def window(ttft=500, itl=50, n=100, waiting=0.0, running=8.0, rate=10.0, pods=2) -> Observation:
    return Observation(start=NOW - 60, end=NOW, num_pods=pods, num_samples=n, ttft_p99_s=ttft / 1000,
                       itl_p99_s=itl / 1000, request_rate=rate, prompt_token_rate=rate * 100,
                       generation_token_rate=rate * 50, waiting=waiting, running=running, queue_time_mean_s=None,
                       kv_usage=0.3, preemption_rate=0.0, error_rate=0.0)


def fleet(obs=None, replicas=2, ready=None, verdict=MET, action=HOLD, **kw) -> Fleet:
    obs = window(pods=replicas) if obs is None else obs
    reading = read(obs, TUNING) if obs is not None and obs.num_samples >= TUNING.min_samples else None
    return Fleet(replicas=replicas, ready=replicas if ready is None else ready, obs=obs, reading=reading,
                 verdict=verdict, tuner_action=action, batch_cap=16, **kw)


OVER = window(ttft=1500, pods=2)  # TTFT 1.5x its SLO
LONG_AGO = ScaleState(last_scale_time=NOW - 1000, last_direction=SCALE_OUT, capacity=5.0)
HEADROOM_LONG = dataclasses.replace(LONG_AGO, headroom_since=NOW - 400)

# title, state, fleet, policy, (action, replicas, condition reason, words in the reason)
ROWS = [
    ("another HPA targets the service: refuse, say which, replicas stay",
     ScaleState(), fleet(OVER, verdict=BOUNDS, conflicts=("chat-hpa",)), POLICY,
     (STAY, 2, "HPAConflict", "chat-hpa")),
    ("below minReplicas: up at once", ScaleState(), fleet(replicas=1), dataclasses.replace(POLICY, min_replicas=3),
     (SCALE_OUT, 3, "ScaledOut", "minReplicas is 3")),
    ("above maxReplicas: down at once", ScaleState(), fleet(replicas=10), POLICY,
     (SCALE_IN, 8, "ScaledIn", "maxReplicas is 8")),
    ("no pod read: nothing known, nothing moves", ScaleState(), fleet(Observation.empty(NOW)), POLICY,
     (STAY, 2, "NoMetrics", "could be read")),
    ("pods added last still starting: no more on the same evidence",
     ScaleState(last_scale_time=NOW - 100, last_direction=SCALE_OUT), fleet(OVER, replicas=4, ready=2,
                                                                            verdict=BOUNDS), POLICY,
     (STAY, 4, "Steady", "2/4 ready")),
    ("pods that never start are waited for only so long",
     ScaleState(last_scale_time=NOW - 700, last_direction=SCALE_OUT), fleet(OVER, replicas=4, ready=2,
                                                                            verdict=BOUNDS), POLICY,
     (SCALE_OUT, 6, "ScaledOut", "BoundsReached")),
    ("a window after a change still holds the fleet before it",
     ScaleState(last_scale_time=NOW - 30, last_direction=SCALE_IN), fleet(OVER, verdict=BOUNDS), POLICY,
     (STAY, 2, "Steady", "30 s left")),
    ("after a scale-out the window counts from when its pods came up",
     ScaleState(last_scale_time=NOW - 300, last_direction=SCALE_OUT, starting=True),
     fleet(OVER, verdict=BOUNDS), POLICY, (STAY, 2, "Steady", "60 s left")),
    ("breach at the bounds: out by how far the p99 is over",
     ScaleState(), fleet(OVER, verdict=BOUNDS), POLICY, (SCALE_OUT, 3, "ScaledOut", "BoundsReached")),
    ("breach with no better setting (all tried made it worse): out",
     ScaleState(), fleet(OVER, replicas=4, verdict=NO_BETTER), POLICY, (SCALE_OUT, 6, "ScaledOut", "NoBetterSetting")),
    ("breach right after a rollback: out", ScaleState(), fleet(OVER, verdict=BREACHED, action=ROLLBACK), POLICY,
     (SCALE_OUT, 3, "ScaledOut", "rolled back")),
    ("breach while the tuner still has a knob to turn: the knobs first",
     ScaleState(), fleet(OVER, verdict=BREACHED, action=RAISE_SEQS), POLICY, (STAY, 2, "Steady", "still correcting")),
    ("observe mode: the knobs never move, a confirmed breach scales",
     ScaleState(), fleet(OVER, verdict=BREACHED, knobs_fixed=True), POLICY, (SCALE_OUT, 3, "ScaledOut", "observe")),
    ("breach at the bounds, but the queue falls fast enough to be gone before new pods could be ready: stay",
     ScaleState(start_s=60, last_queue=(NOW - 30, 100.0)), fleet(window(ttft=1500, waiting=20.0), verdict=BOUNDS),
     POLICY, (STAY, 2, "Steady", "gone in 8 s, before pods asked for now would be ready (the last took 60 s)")),
    ("breach at the bounds, the queue falling too slowly to be gone before new pods are ready: out, sized to "
     "drain it within two windows (10.8 requests/s asked of pods finishing 10), not by the p99's ratio",
     ScaleState(start_s=60, last_queue=(NOW - 30, 100.0)), fleet(window(ttft=1500, waiting=95.0), verdict=BOUNDS),
     POLICY, (SCALE_OUT, 3, "ScaledOut", "sized to drain it within 2 windows")),
    ("breach at the bounds, the queue falling, but no pod start measured yet: out",
     ScaleState(last_queue=(NOW - 30, 100.0)), fleet(window(ttft=1500, waiting=20.0), verdict=BOUNDS),
     POLICY, (SCALE_OUT, 3, "ScaledOut", "BoundsReached")),
    ("... ITL over too: by the p99's ratio (more pods, smaller batches)",
     ScaleState(last_queue=(NOW - 30, 100.0)), fleet(window(ttft=1500, itl=150, waiting=20.0), verdict=BOUNDS),
     POLICY, (SCALE_OUT, 4, "ScaledOut", "BoundsReached")),
    ("a big backlog falling at the bounds: as many pods as drain it within 2 windows",
     ScaleState(last_queue=(NOW - 30, 1000.0)), fleet(window(ttft=1500, waiting=960.0), verdict=BOUNDS),
     POLICY, (SCALE_OUT, 4, "ScaledOut", "the queue falling 1.3 requests/s")),
    ("severe breach: at most double", ScaleState(), fleet(window(ttft=9000, pods=2), verdict=BOUNDS), POLICY,
     (SCALE_OUT, 4, "ScaledOut", "BoundsReached")),
    ("scale-up window not over yet", ScaleState(pressure_since=NOW - 20), fleet(OVER, verdict=BOUNDS),
     dataclasses.replace(POLICY, scale_up_window_s=60), (STAY, 2, "Steady", "40 s left")),
    ("scale-up window over", ScaleState(pressure_since=NOW - 70), fleet(OVER, verdict=BOUNDS),
     dataclasses.replace(POLICY, scale_up_window_s=60), (SCALE_OUT, 3, "ScaledOut", "BoundsReached")),
    ("at maxReplicas: the condition says the SLO needs more than allowed",
     ScaleState(), fleet(window(ttft=1500, pods=8), replicas=8, verdict=BOUNDS), POLICY,
     (STAY, 8, "MaxReplicasReached", "maxReplicas")),
    ("the queue kept growing, whatever the tuner says: out to carry arrivals and drain the queue",
     ScaleState(queue=((NOW - 60, 6.0),)),
     fleet(window(waiting=30.0, rate=4.0), verdict=BREACHED, action=RAISE_SEQS), POLICY,
     (SCALE_OUT, 3, "ScaledOut", "queue grew 0.40 requests/s")),
    ("a growing queue asking for more than one step: the first step, and the goal kept",
     ScaleState(queue=((NOW - 60, 6.0),)),
     fleet(window(waiting=306.0, rate=4.0), verdict=BREACHED, action=RAISE_SEQS), POLICY,
     (SCALE_OUT, 6, "ScaledOut", "on the way to 8")),
    ("the evidence asked for more than one step: the next step follows without waiting for the pods",
     ScaleState(last_scale_time=NOW - 30, last_direction=SCALE_OUT, starting=True, goal=12),
     fleet(OVER, replicas=4, ready=1, verdict=BOUNDS), POLICY, (SCALE_OUT, 8, "ScaledOut", "on the way to the 12")),
    ("a breach over a backlog that is not falling, the tuner still correcting: out to drain it within a window",
     ScaleState(last_queue=(NOW - 5, 40.0)), fleet(window(ttft=1500, waiting=40.0, rate=4.0), verdict=BREACHED,
                                                   action=RAISE_SEQS), POLICY,
     (SCALE_OUT, 3, "ScaledOut", "40 requests waiting, not falling, while 4.00 requests/s finished")),
    ("... falling too slowly to be gone within two windows: out",
     ScaleState(last_queue=(NOW - 10, 41.0)), fleet(window(ttft=1500, waiting=40.0, rate=4.0), verdict=BREACHED,
                                                    action=RAISE_SEQS), POLICY,
     (SCALE_OUT, 3, "ScaledOut", "falling 0.1 requests/s")),
    ("... falling fast enough to be gone within two windows: the knobs go on",
     ScaleState(last_queue=(NOW - 10, 60.0)), fleet(window(ttft=1500, waiting=40.0, rate=4.0), verdict=BREACHED,
                                                    action=RAISE_SEQS), POLICY,
     (STAY, 2, "Steady", "still correcting")),
    ("... gone before pods asked for now could be ready (they take 300 s): stay",
     ScaleState(start_s=300, last_queue=(NOW - 10, 42.0)),
     fleet(window(ttft=1500, waiting=40.0, rate=4.0), verdict=BREACHED, action=RAISE_SEQS), POLICY,
     (STAY, 2, "Steady", "gone in 200 s")),
    ("requests waiting, not falling, with the SLO met (the reading counts their drain in TTFT): stays",
     ScaleState(last_queue=(NOW - 5, 1.5)), fleet(window(ttft=500, waiting=1.5, rate=4.0), verdict=MET), POLICY,
     (STAY, 2, "Steady", "without headroom")),
    ("a queue creeping up by less than a tenth of the completions is noise, not growth",
     ScaleState(queue=((NOW - 30, 3.0),)), fleet(window(waiting=3.5, rate=4.0), verdict=MET), POLICY,
     (STAY, 2, "Steady", "")),
    ("a queue that rose then fell is not growing", ScaleState(queue=((NOW - 120, 2.0), (NOW - 60, 6.0))),
     fleet(window(waiting=5.0, rate=4.0), verdict=MET), POLICY, (STAY, 2, "Steady", "")),
    ("no reading of the window that ended where this one began: overlapping windows are not weighed",
     ScaleState(queue=((NOW - 20, 6.0),)), fleet(window(waiting=30.0, rate=4.0), verdict=MET), POLICY,
     (STAY, 2, "Steady", "")),
    ("headroom, window not over", dataclasses.replace(LONG_AGO, headroom_since=NOW - 100),
     fleet(window(rate=2.0, running=2)), POLICY, (STAY, 2, "Steady", "200 s left")),
    ("headroom for the window and the load fits one pod fewer: in by one",
     HEADROOM_LONG, fleet(window(rate=2.0, running=2), replicas=3), POLICY,
     (SCALE_IN, 2, "ScaledIn", "1.00 requests/s per pod over 2 pods within 80% of the 5.00")),
    ("headroom, but one pod fewer would pass the capacity learned at the last scale-out",
     HEADROOM_LONG, fleet(window(rate=9.0, running=2)), POLICY, (STAY, 2, "Steady", "would pass 80% of the 5.00")),
    ("headroom, but a window since it began finished more than one pod fewer carries: the highest load counts",
     dataclasses.replace(HEADROOM_LONG, loads=(WindowLoad(NOW - 30, NOW - 90, 9.0, 4.0),)),
     fleet(window(rate=2.0, running=2)), POLICY,
     (STAY, 2, "Steady", "9.00 requests/s per pod over 1 pod would pass 80% of the 5.00")),
    ("... a window read before the headroom began does not count",
     dataclasses.replace(HEADROOM_LONG, loads=(WindowLoad(NOW - 30, NOW - 500, 9.0, 4.0),)),
     fleet(window(rate=2.0, running=2)), POLICY, (SCALE_IN, 1, "ScaledIn", "2.00 requests/s per pod over 1 pod")),
    ("... nor one read longer ago than the scale-down window",
     dataclasses.replace(HEADROOM_LONG, loads=(WindowLoad(NOW - 301, NOW - 361, 9.0, 4.0),)),
     fleet(window(rate=2.0, running=2)), POLICY, (SCALE_IN, 1, "ScaledIn", "2.00 requests/s per pod over 1 pod")),
    ("... nor one that began inside the one that first showed the headroom (the load fell: the peak's completions)",
     dataclasses.replace(HEADROOM_LONG, headroom_since=NOW - 300, loads=(WindowLoad(NOW - 185, NOW - 245, 9.0, 4.0),)),
     fleet(window(rate=2.0, running=2)), POLICY, (SCALE_IN, 1, "ScaledIn", "2.00 requests/s per pod over 1 pod")),
    ("... but one that began as it ended does",
     dataclasses.replace(HEADROOM_LONG, headroom_since=NOW - 300, loads=(WindowLoad(NOW - 180, NOW - 240, 9.0, 4.0),)),
     fleet(window(rate=2.0, running=2)), POLICY, (STAY, 2, "Steady", "9.00 requests/s per pod over 1 pod")),
    ("headroom, but one pod fewer would carry more per pod than has been seen within the SLO",
     dataclasses.replace(HEADROOM_LONG, capacity=None, proven=4.0), fleet(window(rate=4.4, running=2)), POLICY,
     (STAY, 2, "Steady", "4.40 requests/s per pod over 1 pod is more than the 4.00")),
    ("headroom, a fleet grown for a peak: as many pods go as the capacity leaves room for",
     HEADROOM_LONG, fleet(window(rate=20.0, running=8, pods=8), replicas=8), POLICY,
     (SCALE_IN, 5, "ScaledIn", "4.00 requests/s per pod over 5 pods within 80% of the 5.00")),
    ("... at most half the fleet at once",
     HEADROOM_LONG, fleet(window(rate=2.0, running=2, pods=8), replicas=8), POLICY,
     (SCALE_IN, 4, "ScaledIn", "0.50 requests/s per pod over 4 pods")),
    ("... no further than the most a pod has been seen to carry within the SLO, none learned",
     dataclasses.replace(HEADROOM_LONG, capacity=None, proven=3.0),
     fleet(window(rate=9.0, running=2, pods=4), replicas=4), POLICY,
     (SCALE_IN, 3, "ScaledIn", "3.00 requests/s per pod over 3 pods")),
    ("... nor past the batch cap's margin",
     HEADROOM_LONG, fleet(window(rate=2.0, running=70, pods=8), replicas=8), POLICY,
     (SCALE_IN, 6, "ScaledIn", "0.33 requests/s per pod over 6 pods")),
    ("headroom, and a capacity known under the knobs in force: it decides, not the most seen within the SLO",
     dataclasses.replace(HEADROOM_LONG, capacity=12.0, proven=2.0), fleet(window(rate=8.0, running=2)), POLICY,
     (SCALE_IN, 1, "ScaledIn", "8.00 requests/s per pod over 1 pod within 80% of the 12.00")),
    ("headroom, but one pod fewer would fill its batch cap",
     dataclasses.replace(HEADROOM_LONG, capacity=None, proven=10.0), fleet(window(rate=2.0, running=14)), POLICY,
     (STAY, 2, "Steady", "max_num_seqs 16")),
    ("... and so it would by Little's law, the gauge read between requests saying less",
     dataclasses.replace(HEADROOM_LONG, capacity=None, proven=10.0),
     fleet(dataclasses.replace(window(rate=2.0, running=4), inference_time_mean_s=7.0)), POLICY,
     (STAY, 2, "Steady", "14.0 requests in flight per pod")),
    ("a quiet fleet (too few requests to measure, none waiting) has headroom",
     HEADROOM_LONG, fleet(window(n=3, rate=0.1, running=0)), POLICY, (SCALE_IN, 1, "ScaledIn", "headroom")),
    ("headroom at minReplicas: stays", HEADROOM_LONG, fleet(window(rate=0.1), replicas=1), POLICY,
     (STAY, 1, "Steady", "minReplicas")),
    ("met without headroom: stays", LONG_AGO, fleet(window(ttft=900)), POLICY, (STAY, 2, "Steady", "without headroom")),
]


@pytest.mark.parametrize("title, state, fleet_, policy, expected", ROWS, ids=[r[0] for r in ROWS])
def test_scale_rules(title, state, fleet_, policy, expected):
    action, replicas, reason, words = expected
    d = decide_scale(state, fleet_, policy, NOW)
    assert (d.action, d.replicas, d.condition.reason) == (action, replicas, reason), d.reason
    assert words in d.reason and words in d.condition.message, d.reason


def test_every_rule_has_a_row():
    """Each rule of the table decides at least one row above."""
    decided = set()
    for _, state, fleet_, policy, _ in ROWS:
        t = Tick(state, fleet_, policy, NOW)
        decided.add(next(rule.__name__ for rule in SCALE_RULES if rule(t) is not None))
    assert decided == {rule.__name__ for rule in SCALE_RULES}


def test_a_scale_out_learns_capacity_and_a_met_window_at_a_higher_rate_raises_it():
    d = decide_scale(ScaleState(), fleet(window(ttft=1500, rate=6.0, running=30), verdict=BOUNDS), POLICY, NOW)
    assert d.action == SCALE_OUT and d.state.capacity == 3.0  # 6 requests/s over the 2 pods read, batches full
    assert d.state.last_scale_time == NOW and d.state.pressure_since is None and d.state.queue == ()
    up = fleet(window(ttft=500, rate=12.0, pods=3), replicas=3)
    settling = decide_scale(d.state, up, POLICY, NOW + 100)  # the new pod is up: a window from now on
    assert settling.state.whole_since == NOW + 100 and settling.state.capacity == 3.0
    assert settling.state.start_s == 100  # how long its pods took: what a draining backlog is weighed against
    assert decide_scale(settling.state, up, POLICY, NOW + 200).state.capacity == 4.0


@pytest.mark.parametrize("running, cap, learned", [
    (24.0, 16, 3.0),  # 12 of 16 per pod: full at the 75% line
    (23.0, 16, None),  # just under it
    (18.0, 16, None),  # one pod full (16), its peer nearly idle: a backlog one pod holds, not the fleet's limit
    (2.0, 0, 3.0),  # the batch cap is not known: the rate is taken as before
])
def test_a_scale_out_learns_capacity_only_from_full_batches(running, cap, learned):
    view = dataclasses.replace(fleet(window(ttft=1500, rate=6.0, running=running), verdict=BOUNDS), batch_cap=cap)
    d = decide_scale(ScaleState(), view, POLICY, NOW)
    assert d.action == SCALE_OUT and d.state.capacity == learned


def test_an_earlier_capacity_survives_a_scale_out_on_idle_batches():
    st = dataclasses.replace(LONG_AGO, capacity=9.0, capacity_knobs=None)
    d = decide_scale(st, fleet(window(ttft=1500, rate=6.0, running=4), verdict=BOUNDS), POLICY, NOW)
    assert d.action == SCALE_OUT and d.state.capacity == 9.0


@pytest.mark.parametrize("start, before, grows", [
    # readings every 10 s, windows of 60 s: this one (60 s from NOW - 60) is weighed against the one whose
    # window ended where it began, NOW - 60, not against the last one (NOW - 10), which shares 50 s with it
    (NOW - 60, ((NOW - 70, 2.0), (NOW - 60, 6.0), (NOW - 10, 9.0)), True),
    (NOW - 60, ((NOW - 70, 2.0), (NOW - 60, 31.0), (NOW - 10, 1.0)), False),  # 31 -> 30: no growth
    (NOW - 63, ((NOW - 60, 6.0), (NOW - 10, 9.0)), True),  # a tick's jitter: within a tenth of the window
    (NOW - 70, ((NOW - 60, 6.0), (NOW - 10, 9.0)), False),  # shares ten seconds of requests with it
])
def test_growth_is_judged_against_the_window_that_ended_where_this_one_began(start, before, grows):
    obs = dataclasses.replace(window(waiting=30.0, rate=4.0), start=start)
    t = Tick(ScaleState(queue=before), fleet(obs, verdict=MET), POLICY, NOW)
    assert (t.growth is not None) is grows, t.chain
    assert t.s.queue == (*before, (NOW, 30.0))  # every reading is kept, for the ticks to come


@pytest.mark.parametrize("length, grows", [(60, True), (30, True), (25, False), (10, False)])
def test_a_window_under_half_the_tuners_is_not_weighed_for_growth(length, grows):
    """At a load's start (and after a knob change) the tuner's window is short: a queue that rose from
    empty over its first seconds is not growth, and its reading is not kept for the ticks to come."""
    before = ((NOW - length - 60, 0.2), (NOW - length, 0.5))
    obs = dataclasses.replace(window(waiting=6.0, rate=0.5), start=NOW - length)
    t = Tick(ScaleState(queue=before), fleet(obs, replicas=1, verdict=MET), POLICY, NOW)
    assert (t.growth is not None) is grows, t.chain
    assert (t.s.queue[-1] == (NOW, 6.0)) is grows
    d = decide_scale(ScaleState(queue=before), fleet(obs, replicas=1, verdict=MET), POLICY, NOW)
    assert d.action == (SCALE_OUT if grows else STAY), d.reason


def test_readings_older_than_the_windows_it_weighs_are_dropped():
    old = tuple((NOW - 10 * k, 1.0) for k in range(30, 0, -1))  # 300 s of readings, windows of 60 s
    t = Tick(ScaleState(queue=old), fleet(window(), verdict=MET), POLICY, NOW)
    assert t.s.queue[0][0] == NOW - 180 and t.s.queue[-1][0] == NOW


def test_headroom_and_pressure_are_timed_from_their_first_window():
    s = decide_scale(ScaleState(), fleet(window(rate=1.0, running=1)), POLICY, NOW).state
    assert s.headroom_since == NOW - 60  # the first window that showed it measured it from its start
    s = decide_scale(s, fleet(window(rate=1.0, running=1)), POLICY, NOW + 30).state
    assert s.headroom_since == NOW - 60  # still the first
    s = decide_scale(s, fleet(window(ttft=900)), POLICY, NOW + 60).state
    assert s.headroom_since is None  # lost: the window starts again


def test_each_whole_window_is_kept_for_the_scale_down_window():
    old = (WindowLoad(NOW - 400, NOW - 460, 9.0, 1.0), WindowLoad(NOW - 100, NOW - 160, 3.0, 1.0))
    t = Tick(ScaleState(loads=old), fleet(window(rate=2.0, running=2)), POLICY, NOW)
    assert t.s.loads == (old[1], WindowLoad(NOW, NOW - 60, 2.0, t.seen.in_batch + t.seen.queued))
    short = dataclasses.replace(window(rate=2.0, running=2), start=NOW - 10)  # after a knob change: not kept
    assert Tick(ScaleState(loads=old), fleet(short), POLICY, NOW).s.loads == (old[1],)


def test_headroom_is_not_dated_back_past_the_last_scale():
    # the window after a change is read only once it lies wholly after it (settling); should it reach back
    # further, the time before the change was another fleet's
    st = ScaleState(last_scale_time=NOW - 30, last_direction=SCALE_IN)
    s = decide_scale(st, fleet(window(rate=1.0, running=1)), dataclasses.replace(POLICY, settle_s=0), NOW).state
    assert s.headroom_since == NOW - 30


@settings(max_examples=300, deadline=None)
@given(replicas=st.integers(1, 40), ready=st.integers(0, 40), ttft=st.floats(10, 20_000), rate=st.floats(0, 100),
       waiting=st.floats(0, 200), running=st.floats(0, 64), samples=st.integers(0, 200),
       verdict=st.sampled_from([MET, BOUNDS, NO_BETTER, BREACHED, NOT_OBSERVED]),
       action=st.sampled_from([HOLD, ROLLBACK, RAISE_SEQS]), since=st.floats(0, 2000),
       capacity=st.none() | st.floats(0.1, 50), lo=st.integers(1, 8), span=st.integers(0, 24),
       start_s=st.none() | st.floats(0, 600), queued_before=st.floats(0, 400), earlier=st.floats(0, 100))
def test_replicas_stay_in_range_grow_at_most_a_step_and_shrink_into_what_fits(
        replicas, ready, ttft, rate, waiting, running, samples, verdict, action, since, capacity, lo, span, start_s,
        queued_before, earlier):
    policy = dataclasses.replace(POLICY, min_replicas=lo, max_replicas=lo + span)
    state = ScaleState(last_scale_time=NOW - since, last_direction=SCALE_OUT, capacity=capacity,
                       headroom_since=NOW - since, pressure_since=NOW - since, start_s=start_s,
                       last_queue=(NOW - 30, queued_before),
                       loads=(WindowLoad(NOW - 20, NOW - since + policy.window_s, earlier, 0.0),))
    obs = window(ttft=ttft, n=samples, waiting=waiting, running=running, rate=rate, pods=max(1, min(ready, replicas)))
    d = decide_scale(state, fleet(obs, replicas=replicas, ready=ready, verdict=verdict, action=action), policy, NOW)
    assert policy.min_replicas <= d.replicas <= policy.max_replicas
    inside = policy.min_replicas <= replicas <= policy.max_replicas
    if inside and d.action == SCALE_IN:  # by one at least, by half the fleet at most, into what fits
        assert max(policy.min_replicas, replicas - max(1, replicas // 2)) <= d.replicas < replicas
        if capacity is not None and d.replicas < replicas - 1:
            # the capacity as this tick left it: a window that met the SLO at a higher per-pod rate raises it
            learned = d.state.capacity
            assert learned is not None and learned >= capacity
            # and of every window since the headroom began
            assert max(rate, earlier) / d.replicas <= (1 - policy.margin) * learned + 1e-9
    if inside and d.action == SCALE_OUT:
        assert replicas < d.replicas <= max(2 * replicas, replicas + 4)
    if d.action == STAY:
        assert d.replicas == replicas
