"""The pure parts of the tuner inside the operator (operator/tuning_loop.py): the daemon's filter, the
LLMService -> TuningPolicy mapping, the metrics source, the Events a tick calls for, the tick schedule.
The loop against a real API server and real pods is tests/test_tuning_e2e.py."""

from __future__ import annotations

import math

import pytest

from iterserve.common.wire import Knobs
from iterserve.operator.spec import Bound, parse_llmservice
from iterserve.operator.tuning.decide import (
    HOLD,
    LOWER_CHUNK,
    NOT_OBSERVED,
    RAISE_SEQS,
    ROLLBACK,
    Condition,
    Decision,
    TunerState,
)
from iterserve.operator.tuning.observe import PodScraper
from iterserve.operator.tuning.policy import InvalidPolicyError, KnobBounds, TuningPolicy
from iterserve.operator.tuning.prometheus import PrometheusSource
from iterserve.operator.tuning.tuner import TuningRecord
from iterserve.operator.tuning_loop import (
    EventMemory,
    events_for,
    metrics_source,
    next_delay,
    policy_from_spec,
    tuned_of,
    tuning_enabled,
)


def llmservice(spec: dict) -> dict:
    return {"apiVersion": "iterserve.io/v1alpha1", "kind": "LLMService",
            "metadata": {"name": "chat", "namespace": "team-a", "uid": "u1", "generation": 1}, "spec": spec}


@pytest.mark.parametrize("spec, enabled", [
    (None, False),
    ({}, False),
    ({"tuning": {}}, False),
    ({"tuning": {"mode": "off"}}, False),
    ({"tuning": {"mode": "observe"}}, True),
    ({"tuning": {"mode": "auto", "intervalSeconds": 5}}, True),
    ({"tuning": None}, False),
])
def test_daemon_runs_only_for_observe_and_auto(spec, enabled):
    assert tuning_enabled(spec) is enabled


AUTO = {"slo": {"ttftP99Ms": 600, "itlP99Ms": 80}, "engine": {"maxNumSeqs": 4, "prefillChunkSize": 128},
        "tuning": {"mode": "auto", "intervalSeconds": 5, "windowSeconds": 10,
                   "bounds": {"maxNumSeqs": {"min": 2, "max": 16}, "prefillChunkSize": {"min": 32, "max": 256}}}}


@pytest.mark.parametrize("spec, expected", [
    (AUTO, dict(ttft_p99_ms=600, itl_p99_ms=80, mode="auto", max_num_seqs_bounds=KnobBounds(2, 16),
                prefill_chunk_size_bounds=KnobBounds(32, 256), interval_s=5.0, window_s=10.0)),
    # an objective left out is never breached
    ({"slo": {"itlP99Ms": 50}, "tuning": {"mode": "auto"}},
     dict(ttft_p99_ms=math.inf, itl_p99_ms=50, mode="auto", interval_s=30.0, window_s=60.0)),
    # observe needs no SLO at all; bounds default to each knob's own limit, as the CRD documents
    ({"tuning": {"mode": "observe"}},
     dict(ttft_p99_ms=math.inf, itl_p99_ms=math.inf, mode="observe", max_num_seqs_bounds=KnobBounds(1, 2**20),
          prefill_chunk_size_bounds=KnobBounds(1, 2**20))),
    # one side of a bound given: the other is the limit
    ({"slo": {"ttftP99Ms": 900}, "engine": {"maxNumSeqs": 8},
      "tuning": {"mode": "auto", "bounds": {"maxNumSeqs": {"max": 8}}}},
     dict(max_num_seqs_bounds=KnobBounds(1, 8), prefill_chunk_size_bounds=KnobBounds(1, 2**20))),
])
def test_policy_from_spec(spec, expected):
    policy = policy_from_spec(parse_llmservice(llmservice(spec)))
    for name, value in expected.items():
        assert getattr(policy, name) == value, name
    defaults = TuningPolicy(ttft_p99_ms=1, itl_p99_ms=1)  # what the spec does not say keeps the defaults
    assert (policy.min_samples, policy.cooldown_s, policy.seqs_step) == (defaults.min_samples, None, defaults.seqs_step)
    assert policy.cooldown == policy.window_s


def test_policy_from_spec_keeps_the_policys_own_validation():
    svc = parse_llmservice(llmservice(AUTO))
    # parse_llmservice already refuses min > max; the policy would refuse it too, naming its field
    object.__setattr__(svc.tuning, "bounds", svc.tuning.bounds | {"max_num_seqs": Bound(min=9, max=3)})
    with pytest.raises(InvalidPolicyError, match="max_num_seqs_bounds"):
        policy_from_spec(svc)


def test_metrics_source_is_prometheus_only_when_configured():
    assert isinstance(metrics_source(None, 2.0), PodScraper)
    assert isinstance(metrics_source("", 2.0), PodScraper)
    source = metrics_source("http://prometheus:9090/", 2.0)
    assert isinstance(source, PrometheusSource) and source.url == "http://prometheus:9090" and source.selector is None


@pytest.mark.parametrize("interval, elapsed, delay", [(5, 0.5, 4.5), (5, 5, 0), (5, 7.2, 0), (30, 0, 30)])
def test_ticks_start_every_interval(interval, elapsed, delay):
    assert next_delay(interval, elapsed) == pytest.approx(delay)


def test_tuned_of_reads_the_current_condition():
    assert tuned_of({}) is None
    ready = {"type": "Ready", "status": "True", "reason": "AllReplicasReady"}
    assert tuned_of({"status": {"conditions": [ready]}}) is None
    body = {"status": {"conditions": [{"type": "Tuned", "status": "True", "reason": "SLOMet"}]}}
    assert tuned_of(body) == ("True", "SLOMet")


START = Knobs(max_num_seqs=4, max_num_batched_tokens=512, prefill_chunk_size=128)
MET = Condition("True", "SLOMet", "p99 TTFT 120 ms (SLO 600 ms)")
BREACHED = Condition("False", "SLOBreached", "p99 TTFT 900 ms (SLO 600 ms)")
AT_BOUNDS = Condition("False", "BoundsReached", "max_num_seqs at its upper bound")


def record(action=HOLD, target=None, *, applied=False, changed=False, tuned=MET, knobs=START, slo_met=True,
           errors=()) -> TuningRecord:
    decision = Decision(action, f"because ({action})", 1000.0, target, applied, slo_met, tuned, TunerState(knobs))
    return TuningRecord("team-a", "chat", 1000.0, knobs, None, decision, changed, tuple(errors))


def reasons(events) -> list[str]:
    return [e["reason"] for e in events]


def test_every_change_is_an_event_and_each_tuned_transition_one_more():
    memory = EventMemory(tuned=("Unknown", "NotObserved"))
    raised = START.replace(max_num_seqs=6)
    steps = [
        (record(tuned=NOT_OBSERVED, slo_met=None), []),
        (record(RAISE_SEQS, raised, applied=True, changed=True, tuned=BREACHED, slo_met=False),
         ["KnobsChanged", "SLOBreached"]),
        (record(tuned=BREACHED, knobs=raised, slo_met=None), []),  # cooling down: nothing new
        (record(RAISE_SEQS, raised.replace(max_num_seqs=8), applied=True, changed=True, tuned=BREACHED,
                knobs=raised, slo_met=False), ["KnobsChanged"]),
        (record(tuned=MET, knobs=raised), ["SLOMet"]),
        (record(tuned=MET, knobs=raised), []),
        (record(ROLLBACK, START, applied=True, changed=True, tuned=BREACHED, knobs=raised, slo_met=False),
         ["KnobsRolledBack", "SLOBreached"]),
        (record(tuned=AT_BOUNDS, knobs=START, slo_met=False), ["BoundsReached"]),
    ]
    for i, (rec, expected) in enumerate(steps):
        events = events_for(rec, memory)
        assert reasons(events) == expected, i
    kinds = {e["reason"]: e["type"] for step in steps for e in events_for(step[0], EventMemory())}
    assert kinds["KnobsChanged"] == "Normal" and kinds["KnobsRolledBack"] == "Warning"
    assert kinds["BoundsReached"] == "Warning" and kinds["SLOMet"] == "Normal" and kinds["SLOBreached"] == "Normal"


def test_event_messages_say_what_and_why():
    raised = START.replace(max_num_seqs=6)
    change, transition = events_for(record(RAISE_SEQS, raised, applied=True, changed=True, tuned=BREACHED,
                                           slo_met=False), EventMemory(tuned=("True", "SLOMet")))
    assert "raise_max_num_seqs" in change["message"] and "max_num_seqs=6" in change["message"]
    assert "because" in change["message"]
    assert transition["message"] == f"Tuned=False: {BREACHED.message}"


def test_a_standing_recommendation_is_one_event_until_it_changes():
    memory = EventMemory(tuned=("False", "SLOBreached"))
    raised = START.replace(max_num_seqs=6)
    smaller = START.replace(prefill_chunk_size=64)
    recommend = lambda target, action=RAISE_SEQS: record(action, target, tuned=BREACHED, slo_met=False)  # noqa: E731
    assert reasons(events_for(recommend(raised), memory)) == ["KnobsRecommended"]
    assert reasons(events_for(recommend(raised), memory)) == []  # the same advice, tick after tick
    assert reasons(events_for(record(tuned=BREACHED, slo_met=None), memory)) == []  # a quiet window keeps it
    assert reasons(events_for(recommend(smaller, LOWER_CHUNK), memory)) == ["KnobsRecommended"]
    assert reasons(events_for(recommend(raised), memory)) == ["KnobsRecommended"]
    # once the SLO is met where it stands, the same advice later is news again
    assert reasons(events_for(record(tuned=MET), memory)) == ["SLOMet"]
    assert reasons(events_for(recommend(raised), memory)) == ["KnobsRecommended", "SLOBreached"]


def test_a_failing_change_is_reported_once_per_target():
    memory = EventMemory(tuned=("False", "SLOBreached"))
    raised = START.replace(max_num_seqs=6)
    failed = record(RAISE_SEQS, raised, applied=True, changed=False, tuned=BREACHED, slo_met=False,
                    errors=["http://10.0.0.7:8000/admin/scheduler: ConnectError"])
    (event,) = events_for(failed, memory)
    assert event["type"] == "Warning" and event["reason"] == "KnobsNotApplied" and "ConnectError" in event["message"]
    assert events_for(failed, memory) == []
    assert reasons(events_for(record(RAISE_SEQS, raised, applied=True, changed=True, tuned=BREACHED,
                                     slo_met=False), memory)) == ["KnobsChanged"]


@pytest.mark.parametrize("argv, env, message", [
    (["--metrics-port", "0"], None, "--metrics-port must be in 1..65535, got 0"),
    ([], "70000", "--metrics-port must be in 1..65535, got 70000"),
    (["--workers", "0"], None, "--workers must be >= 1, got 0"),
])
def test_operator_refuses_a_bad_metrics_port(argv, env, message, monkeypatch, capsys):
    import argparse

    from iterserve.operator import cli

    if env is not None:
        monkeypatch.setenv("ITERSERVE_OPERATOR_METRICS_PORT", env)
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    args = parser.parse_args(["operator", "--standalone", *argv])
    assert cli.run(args) == 2  # before anything is started
    assert message in capsys.readouterr().out
