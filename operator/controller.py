"""One reconcile of one LLMService from start to status: what every kopf handler calls (no kopf here).

Runs under a per-object lock, so the change handlers, the drift timer, the Deployment watch and the
tuner (which takes the same lock before it touches the knobs) never interleave on one LLMService
inside this process. Across processes, leader election (operator/leader.py) keeps one active.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass, field

from kubernetes.client.exceptions import ApiException

from iterserve.operator.autoscaling import with_replicas_in_force
from iterserve.operator.builders.configmap import knobs_from_configmap
from iterserve.operator.builders.labels import knobs_configmap_name, router_name
from iterserve.operator.builders.networkpolicy import OperatorPeer
from iterserve.operator.conditions import DEGRADED, TUNED, get_condition, now_iso, set_condition, transitions
from iterserve.operator.constants import GROUP, KIND, VERSION
from iterserve.operator.kube import Kube, is_status
from iterserve.operator.reconcile import Change, reconcile, short_error
from iterserve.operator.spec import LLMService, SpecError, parse_llmservice
from iterserve.operator.status import ReconcileResult, compute_status

API_VERSION = f"{GROUP}/{VERSION}"
MAX_STATUS_RETRIES = 5

_locks: dict[tuple[str, str], threading.RLock] = defaultdict(threading.RLock)
_locks_guard = threading.Lock()


def object_lock(namespace: str, name: str) -> threading.RLock:
    """The (re-entrant) lock that serializes every writer of one LLMService's children, knobs and status."""
    with _locks_guard:
        return _locks[(namespace, name)]


@dataclass
class Result:
    changes: list[Change] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    spec_error: SpecError | None = None
    transitions: list[dict] = field(default_factory=list)  # conditions whose status or reason changed
    gone: bool = False  # the LLMService was deleted meanwhile


def patch_status(kube: Kube, namespace: str, name: str, compute, read: dict | None = None) -> tuple[dict, dict] | None:
    """Read-modify-write of the status, guarded by resourceVersion so that concurrent writers (the
    reconcile and the tuner own different fields) never overwrite each other. `compute(current_status)`
    returns the fields to merge in. `read`: the LLMService as just read under the object lock, saving the
    first GET (a write in between fails the resourceVersion check and is read again). Returns (before,
    patch), or None when the LLMService is gone."""
    for _ in range(MAX_STATUS_RETRIES):
        current, read = (read, None) if read is not None else (kube.get_llmservice(namespace, name), None)
        if current is None or current["metadata"].get("deletionTimestamp"):
            return None
        before = current.get("status") or {}
        fields = compute(before)
        if all(before.get(key) == value for key, value in fields.items()):
            return before, {}  # nothing new: no write, no watch event
        patch = {"metadata": {"resourceVersion": current["metadata"]["resourceVersion"]}, "status": fields}
        try:
            kube.merge_patch(API_VERSION, KIND, namespace, name, patch, subresource="status")
        except ApiException as e:
            if is_status(e, 409):
                continue
            if is_status(e, 404):
                return None
            raise
        return before, fields
    raise RuntimeError(f"status of {namespace}/{name}: still conflicting after {MAX_STATUS_RETRIES} tries")


def write_status(kube: Kube, namespace: str, name: str, obs: ReconcileResult,
                 read: dict | None = None) -> tuple[list[dict], bool]:
    """The operator's part of the status. Returns (condition transitions, gone)."""
    written = patch_status(kube, namespace, name, lambda before: compute_status(obs, before, now_iso()), read)
    if written is None:
        return [], True
    before, fields = written
    return (transitions(before.get("conditions"), fields["conditions"]) if fields else []), False


def write_tuning_status(kube: Kube, namespace: str, name: str, fields: dict, tuned: dict) -> bool:
    """The tuner's part of the status (e.g. `TuningRecord.status()`; None removes a field) and its Tuned
    condition (type, status, reason, message), lastTransitionTime kept while its status holds.
    False when the LLMService is gone."""
    def compute(before: dict) -> dict:
        conditions = set_condition(before.get("conditions"), TUNED, tuned["status"], tuned["reason"],
                                   tuned.get("message", ""), observed_generation=before.get("observedGeneration"))
        return {**same_decision_kept(fields, before), "conditions": conditions}

    with object_lock(namespace, name):
        return patch_status(kube, namespace, name, compute) is not None


def same_decision_kept(fields: dict, before: dict) -> dict:
    """`fields` with lastDecision as `before` has it when only its time differs: the time says since when
    the decision (action, reason and the figures in it) stands, and a tick that reaches it again writes
    nothing, rather than a status PATCH (and a watch event to every watcher) per service and tick."""
    new, old = fields.get("lastDecision"), before.get("lastDecision")
    if isinstance(new, dict) and isinstance(old, dict) and {**new, "time": old.get("time")} == old:
        return {**fields, "lastDecision": old}
    return fields


def handle(kube: Kube, body: dict, *, pod_timeout: float = 3.0, operator: OperatorPeer = OperatorPeer()) -> Result:
    """Reconcile the LLMService `body` (as kopf or the API gave it) and write its status."""
    meta = body["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    with object_lock(namespace, name):
        result = Result()
        # the object as stored now, read under the lock: kopf's copy (a timer's especially) can be older
        # than the spec another pass has just applied, and reconciling it would roll that spec back
        current = _current(kube, namespace, name, meta.get("uid"))
        if current is None:
            result.gone = True
            return result
        body = current
        generation = int(body["metadata"].get("generation") or 0)
        try:
            svc = with_replicas_in_force(parse_llmservice(body), body.get("status"))
        except SpecError as e:
            # leave the children as they are (the last good spec keeps serving) and say why
            result.spec_error = e
            deployment = _get_deployment(kube, namespace, name, result)
            obs = ReconcileResult(name=name, generation=generation, deployment=deployment, spec_error=str(e),
                              problems=result.problems)
        else:
            outcome = reconcile(kube, svc, pod_timeout=pod_timeout, operator=operator)
            result.changes, result.problems = outcome.changes, outcome.problems
            obs = ReconcileResult(name=name, generation=generation, replicas_wanted=svc.replicas,
                                  autoscaling=svc.autoscaling is not None, tuning_mode=svc.tuning.mode,
                                  deployment=outcome.deployment, knobs=outcome.knobs, problems=outcome.problems,
                                  **_router_fields(svc, outcome.router))
        result.transitions, result.gone = write_status(kube, namespace, name, obs, read=current)
        return result


def refresh_status(kube: Kube, namespace: str, name: str) -> Result:
    """Only the status, from the Deployment and ConfigMap as they are now (after a Deployment status
    change). observedGeneration stays: this looked at no spec change. Before the first full pass has
    written a status, nothing."""
    result = Result()
    with object_lock(namespace, name):
        # read under the lock: a snapshot taken before it would carry the status from before the
        # reconcile that holds the lock now, and write its older observedGeneration back
        body = _current(kube, namespace, name)
        if body is None:
            result.gone = True
            return result
        status = body.get("status") or {}
        if "observedGeneration" not in status:
            # no full pass has finished yet (one cut short, or still running): a refresh would claim a
            # generation whose children nobody has checked, and kubectl wait would take it as applied
            return result
        try:
            svc = with_replicas_in_force(parse_llmservice(body), status)
        except SpecError:
            return result  # the change handlers report invalid specs
        deployment = _get_deployment(kube, namespace, name, result)
        try:
            knobs = knobs_from_configmap(kube.get("v1", "ConfigMap", namespace, knobs_configmap_name(name)))
        except ApiException as e:
            knobs = None
            result.problems.append(f"reading the knobs ConfigMap: {short_error(e)}")
        # a Degraded condition from the last full reconcile stands: this refresh did not look at children
        degraded = get_condition(status.get("conditions"), DEGRADED) or {}
        if degraded.get("status") == "True" and degraded.get("reason") == "ReconcileFailed":
            result.problems.append(degraded.get("message", ""))
        router = _get_deployment(kube, namespace, router_name(name), result) if svc.router.enabled else None
        obs = ReconcileResult(name=name, generation=status["observedGeneration"],
                              replicas_wanted=svc.replicas, autoscaling=svc.autoscaling is not None,
                              tuning_mode=svc.tuning.mode, deployment=deployment,
                              knobs=knobs, problems=result.problems, **_router_fields(svc, router))
        result.transitions, result.gone = write_status(kube, namespace, name, obs, read=body)
        return result


def _current(kube: Kube, namespace: str, name: str, uid: str | None = None) -> dict | None:
    """The LLMService as stored, or None when it is gone, being deleted, or (given `uid`) replaced by a
    new object of the same name."""
    body = kube.get_llmservice(namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return None
    if uid and body["metadata"].get("uid") != uid:
        return None
    return body


def _router_fields(svc: LLMService, router: dict | None) -> dict:
    """ReconcileResult's router fields: Ready waits for the router's pods while spec.router is on."""
    return {"router_replicas": svc.router.replicas, "router": router} if svc.router.enabled else {}


def _get_deployment(kube: Kube, namespace: str, name: str, result: Result) -> dict | None:
    try:
        return kube.get("apps/v1", "Deployment", namespace, name)
    except ApiException as e:
        result.problems.append(f"reading the Deployment {name}: {short_error(e)}")
        return None
