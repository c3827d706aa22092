"""Conditions replaced by type, the status computed from a Deployment's state, and drift detection."""

from __future__ import annotations

import pytest

from iterserve.operator.conditions import get_condition, set_condition, transitions
from iterserve.operator.drift import differences, foreign_owner
from iterserve.operator.status import ReconcileResult, compute_status

T0, T1 = "2025-01-01T00:00:00Z", "2025-01-01T00:05:00Z"


def test_set_condition_replaces_by_type_and_keeps_transition_time_while_status_holds():
    conditions = set_condition([], "Ready", False, "ReplicasNotReady", "0/1", now=T0)
    conditions = set_condition(conditions, "Degraded", False, "AsExpected", now=T0)
    same = set_condition(conditions, "Ready", False, "ReplicasNotReady", "still 0/1", observed_generation=2, now=T1)
    assert [c["type"] for c in same] == ["Ready", "Degraded"]
    assert get_condition(same, "Ready")["lastTransitionTime"] == T0
    assert get_condition(same, "Ready")["message"] == "still 0/1"
    assert get_condition(same, "Ready")["observedGeneration"] == 2
    flipped = set_condition(same, "Ready", True, "AllReplicasReady", now=T1)
    assert get_condition(flipped, "Ready")["lastTransitionTime"] == T1
    assert len(flipped) == 2
    assert [c["type"] for c in transitions(same, flipped)] == ["Ready"]
    assert set_condition([], "Tuned", None, "Waiting", now=T0)[0]["status"] == "Unknown"
    with pytest.raises(ValueError):
        set_condition([], "Ready", "yes", "X")


def deployment(*, replicas=2, ready=2, updated=2, available=2, total=2, generation=3, observed=3, conditions=()):
    return {"metadata": {"generation": generation}, "spec": {"replicas": replicas},
            "status": {"observedGeneration": observed, "replicas": total, "readyReplicas": ready,
                       "updatedReplicas": updated, "availableReplicas": available,
                       "conditions": list(conditions)}}


def conditions_of(obs: ReconcileResult, current=None) -> dict[str, tuple[str, str]]:
    status = compute_status(obs, current, T0)
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


STATES = [
    ("no deployment yet", dict(deployment=None), {"Ready": ("False", "DeploymentMissing"),
                                                  "Progressing": ("True", "Creating")}),
    ("all ready", dict(deployment=deployment()), {"Ready": ("True", "AllReplicasReady"),
                                                  "Progressing": ("False", "RolloutComplete"),
                                                  "Degraded": ("False", "AsExpected")}),
    ("starting", dict(deployment=deployment(ready=0, available=0)), {"Ready": ("False", "ReplicasNotReady"),
                                                                      "Progressing": ("True", "RollingOut")}),
    ("template not seen yet", dict(deployment=deployment(observed=2)), {"Progressing": ("True", "RollingOut")}),
    ("old pods terminating", dict(deployment=deployment(total=3)), {"Ready": ("True", "AllReplicasReady"),
                                                                     "Progressing": ("True", "RollingOut")}),
    ("scaled to zero", dict(replicas_wanted=0, deployment=deployment(replicas=0, ready=0, updated=0, available=0,
                                                                     total=0)),
     {"Ready": ("False", "ScaledToZero"), "Progressing": ("False", "RolloutComplete")}),
    ("stuck rollout", dict(deployment=deployment(ready=1, conditions=[
        {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded", "message": "too slow"}])),
     {"Degraded": ("True", "RolloutFailed")}),
    ("invalid spec", dict(replicas_wanted=None, spec_error="spec.model.path: required", deployment=deployment()),
     {"Degraded": ("True", "InvalidSpec"), "Progressing": ("False", "InvalidSpec"),
      "Ready": ("True", "AllReplicasReady")}),
    ("child failed", dict(problems=["Service: HTTP 403: forbidden"], deployment=deployment()),
     {"Degraded": ("True", "ReconcileFailed")}),
    ("router on, its Deployment not there yet", dict(deployment=deployment(), router_replicas=1),
     {"Ready": ("False", "RouterMissing")}),
    ("router on, not ready", dict(deployment=deployment(), router_replicas=2, router=deployment(ready=1)),
     {"Ready": ("False", "RouterNotReady"), "Progressing": ("False", "RolloutComplete")}),
    ("router on and ready", dict(deployment=deployment(), router_replicas=2, router=deployment()),
     {"Ready": ("True", "AllReplicasReady")}),
    ("router ready, server pods not", dict(deployment=deployment(ready=1), router_replicas=1, router=deployment()),
     {"Ready": ("False", "ReplicasNotReady")}),
    ("router off: a leftover router Deployment is not looked at", dict(deployment=deployment(),
                                                                       router=deployment(ready=0)),
     {"Ready": ("True", "AllReplicasReady")}),
    ("tuning off", dict(tuning_mode="off", deployment=deployment()), {"Tuned": ("False", "TuningOff")}),
    ("tuning auto, no decision yet", dict(tuning_mode="auto", deployment=deployment()),
     {"Tuned": ("Unknown", "WaitingForMetrics")}),
]


@pytest.mark.parametrize("title, fields, expected", STATES, ids=[s[0] for s in STATES])
def test_conditions_follow_the_deployment(title, fields, expected):
    obs = ReconcileResult(name="chat", generation=3, **{"replicas_wanted": 2, **fields})
    got = conditions_of(obs)
    assert {k: got[k] for k in expected} == expected


def test_status_fields_and_the_tuners_condition_is_left_alone():
    tuned = {"type": "Tuned", "status": "True", "reason": "WithinSLO", "message": "", "lastTransitionTime": T0}
    current = {"conditions": [tuned], "ttftP99Ms": 120.0}
    obs = ReconcileResult(name="chat", generation=5, replicas_wanted=2, tuning_mode="auto",
                      deployment=deployment(ready=1), knobs={"max_num_seqs": 8, "max_num_batched_tokens": 512,
                                                             "prefill_chunk_size": 64})
    status = compute_status(obs, current, T1)
    assert get_condition(status["conditions"], "Tuned") == tuned
    assert (status["observedGeneration"], status["replicas"], status["readyReplicas"]) == (5, 2, 1)
    assert status["selector"] == "app.kubernetes.io/name=iterserve,app.kubernetes.io/instance=chat"
    assert status["knobs"] == {"maxNumSeqs": 8, "maxNumBatchedTokens": 512, "prefillChunkSize": 64}
    assert "ttftP99Ms" not in status  # the tuner's field: not rewritten by the operator


def test_ready_message_counts_the_router():
    obs = ReconcileResult(name="chat", generation=3, replicas_wanted=2, deployment=deployment(), router_replicas=2,
                          router=deployment(ready=1))
    ready = get_condition(compute_status(obs, None, T0)["conditions"], "Ready")
    assert ready["message"] == "2/2 replicas ready; router 1/2 ready"
    obs.router = deployment()
    ready = get_condition(compute_status(obs, None, T0)["conditions"], "Ready")
    assert ready["message"] == "2/2 replicas ready, router 2/2"


@pytest.mark.parametrize("observed_before, generation, expected", [
    (None, 3, 3), (2, 3, 3), (3, 3, 3),
    (10, 8, 10),  # a writer holding an older snapshot: the recorded generation stands
])
def test_observed_generation_never_goes_backwards(observed_before, generation, expected):
    current = {} if observed_before is None else {"observedGeneration": observed_before}
    status = compute_status(ReconcileResult(name="chat", generation=generation, replicas_wanted=1,
                                        deployment=deployment()), current, T0)
    assert status["observedGeneration"] == expected
    assert {c["observedGeneration"] for c in status["conditions"]} == {expected}


@pytest.mark.parametrize("desired, actual, paths", [
    ({"a": 1, "b": {"c": "x"}}, {"a": 1, "b": {"c": "x", "extra": 2}, "status": {}}, []),
    ({"a": 1}, {"a": 2}, ["a"]),
    ({"b": {"c": "x"}}, {}, ["b"]),
    ({"l": [{"n": 1}, {"n": 2}]}, {"l": [{"n": 1, "d": 0}, {"n": 3}]}, ["l[1].n"]),
    ({"l": [1, 2]}, {"l": [1]}, ["l"]),
    ({"limits": {"nvidia.com/gpu": 1}}, {"limits": {"nvidia.com/gpu": "1"}}, []),
])
def test_differences(desired, actual, paths):
    assert differences(desired, actual) == paths


def test_foreign_owner():
    ours = {"metadata": {"ownerReferences": [{"controller": True, "uid": "u1", "kind": "LLMService", "name": "a"}]}}
    theirs = {"metadata": {"ownerReferences": [{"controller": True, "uid": "u9", "kind": "Helm", "name": "x"}]}}
    orphan = {"metadata": {"labels": {"app.kubernetes.io/managed-by": "iterserve-operator"}}}
    assert foreign_owner(ours, "u1") is None and foreign_owner(orphan, "u1") is None
    assert "Helm x" in foreign_owner(theirs, "u1")
    assert "not created by the operator" in foreign_owner({"metadata": {}}, "u1")
