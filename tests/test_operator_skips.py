"""What lets a pass skip a write: the applied digest and drift check on children, and a tuner tick that
reached the same decision again (pure functions; the real API server's side is in
test_operator_integration.py)."""

from __future__ import annotations

import copy

import pytest

from iterserve.operator.child_cache import ChildCache
from iterserve.operator.controller import same_decision_kept
from iterserve.operator.drift import APPLIED_DIGEST_ANNOTATION, apply_needed, with_applied_digest

DESIRED = {"apiVersion": "v1", "kind": "Service",
           "metadata": {"name": "chat", "namespace": "ns", "labels": {"app": "chat"}},
           "spec": {"selector": {"app": "chat"}, "ports": [{"name": "http", "port": 80, "targetPort": 8000}]}}


def stored(desired: dict, **changes) -> dict:
    """`desired` as the API server would store it after an apply: defaults and status added."""
    obj = copy.deepcopy(desired)
    obj["metadata"].update(resourceVersion="7", uid="u1", managedFields=[])
    obj["spec"].update(clusterIP="10.0.0.9", sessionAffinity="None")
    obj["spec"]["ports"][0]["protocol"] = "TCP"
    obj["status"] = {"loadBalancer": {}}
    for path, value in changes.items():
        *parents, last = path.split("__")
        target = obj
        for key in parents:
            target = target[key]
        if value is None:
            del target[last]
        else:
            target[last] = value
    return obj


def test_the_digest_is_of_the_rendering_and_does_not_change_the_input():
    before = copy.deepcopy(DESIRED)
    stamped = with_applied_digest(DESIRED)
    assert DESIRED == before
    digest = stamped["metadata"]["annotations"][APPLIED_DIGEST_ANNOTATION]
    assert len(digest) == 16
    assert with_applied_digest(stamped) == stamped  # stamping again: the same digest
    moved = copy.deepcopy(DESIRED)
    moved["spec"]["ports"][0]["port"] = 81
    assert with_applied_digest(moved)["metadata"]["annotations"][APPLIED_DIGEST_ANNOTATION] != digest
    annotated = copy.deepcopy(DESIRED)
    annotated["metadata"]["annotations"] = {"team": "a"}
    assert with_applied_digest(annotated)["metadata"]["annotations"]["team"] == "a"


STAMPED = with_applied_digest(DESIRED)
DROPPED = copy.deepcopy(DESIRED)  # a rendering that no longer sets a field the stored object has
del DROPPED["metadata"]["labels"]["app"]
DROPPED["metadata"]["labels"]["tier"] = "x"


@pytest.mark.parametrize("title, desired, actual, needed", [
    ("missing", STAMPED, None, ["(missing)"]),
    ("as applied, with the server's defaults", STAMPED, stored(STAMPED), []),
    ("someone else's label: not ours to remove", STAMPED,
     stored(STAMPED, metadata__labels={"app": "chat", "other": "y"}), []),
    ("a field of ours edited", STAMPED, stored(STAMPED, spec__ports=[{"name": "http", "port": 81, "targetPort": 8000,
                                                                        "protocol": "TCP"}]), ["spec.ports[0].port"]),
    ("a field of ours removed", STAMPED, stored(STAMPED, spec__ports=[]), ["spec.ports"]),
    ("a key added to an atomic selector", STAMPED, stored(STAMPED, spec__selector={"app": "chat", "x": "1"}),
     ["spec.selector"]),
    ("applied before the digest existed", STAMPED, stored(DESIRED), ["metadata.annotations"]),
    ("a rendering that drops a field: only the digest tells", with_applied_digest(DROPPED),
     stored(STAMPED, metadata__labels={"app": "chat", "tier": "x"}),
     [f"metadata.annotations.{APPLIED_DIGEST_ANNOTATION}"]),
])
def test_apply_needed(title, desired, actual, needed):
    assert apply_needed(desired, actual) == needed


DECISION = {"action": "hold", "reason": "SLO met: TTFT p99 20.0 ms", "time": "2026-01-01T00:00:30Z"}


@pytest.mark.parametrize("title, new, before, kept_time", [
    ("the same decision again: the time it was first reached stays", {**DECISION, "time": "2026-01-01T00:01:00Z"},
     DECISION, DECISION["time"]),
    ("other figures: a new decision", {**DECISION, "reason": "SLO met: TTFT p99 21.0 ms",
                                       "time": "2026-01-01T00:01:00Z"}, DECISION, "2026-01-01T00:01:00Z"),
    ("another action", {**DECISION, "action": "raise_max_num_seqs", "time": "2026-01-01T00:01:00Z"}, DECISION,
     "2026-01-01T00:01:00Z"),
    ("nothing before", {**DECISION, "time": "2026-01-01T00:01:00Z"}, None, "2026-01-01T00:01:00Z"),
])
def test_same_decision_kept(title, new, before, kept_time):
    fields = {"ttftP99Ms": 20.0, "lastDecision": new}
    kept = same_decision_kept(fields, {"ttftP99Ms": 20.0, "lastDecision": before} if before else {})
    assert kept["lastDecision"]["time"] == kept_time
    assert kept["ttftP99Ms"] == 20.0
    assert {k: v for k, v in kept["lastDecision"].items() if k != "time"} == \
        {k: v for k, v in new.items() if k != "time"}


def deployment_event(name: str, labels: dict | None, **meta) -> dict:
    return {"metadata": {"namespace": "ns", "name": name, "labels": labels or {}, **meta}}


OURS = {"app.kubernetes.io/managed-by": "iterserve-operator"}


@pytest.mark.parametrize("title, events, cached", [
    ("listed and added", [(None, deployment_event("a", OURS)), ("ADDED", deployment_event("b", OURS))], ["a", "b"]),
    ("someone else's Deployment", [("ADDED", deployment_event("c", {"app": "c"}))], []),
    ("our label taken away", [("ADDED", deployment_event("a", OURS)), ("MODIFIED", deployment_event("a", {}))], []),
    ("deleted", [("ADDED", deployment_event("a", OURS)), ("DELETED", deployment_event("a", OURS))], []),
    ("being deleted", [("ADDED", deployment_event("a", OURS)),
                       ("MODIFIED", deployment_event("a", OURS, deletionTimestamp="2026-01-01T00:00:00Z"))], []),
])
def test_child_cache_holds_only_ours_as_last_seen(title, events, cached):
    cache = ChildCache("Deployment")
    for event_type, obj in events:
        cache.observe(event_type, obj)
    assert [name for name in "abc" if cache.get("ns", name) is not None] == cached
    assert len(cache) == len(cached)


def test_child_cache_keeps_the_latest_event():
    cache = ChildCache("Deployment")
    cache.observe("ADDED", deployment_event("a", OURS, resourceVersion="1"))
    cache.observe("MODIFIED", deployment_event("a", OURS, resourceVersion="2"))
    assert cache.get("ns", "a")["metadata"]["resourceVersion"] == "2"
    assert cache.get("other", "a") is None


@pytest.mark.parametrize("title, synced, entries, ask, absent", [
    ("not listed yet: absence proves nothing", [], [], ("ns", "a"), False),
    ("listed, none of ours", ["ns"], [], ("ns", "a"), True),
    ("listed, ours there", ["ns"], ["a"], ("ns", "a"), False),
    ("another namespace listed", ["other"], [], ("ns", "a"), False),
    ("every namespace listed", [None], [], ("ns", "a"), True),
])
def test_child_cache_knows_absence_only_after_a_listing(title, synced, entries, ask, absent):
    cache = ChildCache("Service")
    for scope in synced:
        cache.replace(scope, [deployment_event(name, OURS) for name in entries])
    assert cache.absent(*ask) is absent


def test_a_listing_replaces_its_scope_and_a_broken_watch_unsyncs_it():
    cache = ChildCache("Service")
    cache.observe("ADDED", deployment_event("gone", OURS))
    cache.observe("ADDED", {"metadata": {"namespace": "other", "name": "kept", "labels": OURS}})
    cache.replace("ns", [deployment_event("a", OURS), deployment_event("theirs", {"app": "x"})])
    assert cache.get("ns", "gone") is None and cache.get("other", "kept") is not None  # only ns relisted
    assert cache.get("ns", "a") is not None and cache.absent("ns", "theirs")  # not ours: not held
    cache.replace(None, [deployment_event("a", OURS)])
    assert cache.get("other", "kept") is None and len(cache) == 1  # a cluster listing replaces everything
    cache.unsync(None)
    assert cache.absent("ns", "b")  # ns's own listing still stands
    cache.unsync("ns")
    assert not cache.absent("ns", "b") and cache.select("ns", {}) is None


def test_child_cache_selects_by_labels_in_one_namespace():
    cache = ChildCache("Pod")
    assert cache.select("ns", {}) is None  # before the listing: ask the server
    pod = {**OURS, "app.kubernetes.io/instance": "chat"}
    other = {**OURS, "app.kubernetes.io/instance": "x"}
    cache.replace("ns", [deployment_event("p1", pod), deployment_event("p2", other)])
    cache.observe("ADDED", {"metadata": {"namespace": "other", "name": "p3", "labels": pod}})
    assert [p["metadata"]["name"] for p in cache.select("ns", {"app.kubernetes.io/instance": "chat"})] == ["p1"]
    assert cache.select("other", {}) is None  # "other" was never listed
