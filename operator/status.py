"""The status the operator writes on an LLMService, computed from what it observed (pure).

The operator owns observedGeneration, replicas, readyReplicas, updatedReplicas, selector, knobs and
the Ready (the server pods and, with spec.router, the router's), Progressing and Degraded conditions,
and desiredReplicas without spec.autoscaling (with it, the autoscaler owns desiredReplicas, lastScale
and the Autoscaling condition: operator/scaling_loop.py). The tuner owns ttftP99Ms, itlP99Ms, kvCacheUsage,
lastDecision and the Tuned condition; the operator only sets Tuned while tuning is off, or to Unknown
before the tuner said anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from iterserve.operator.builders.labels import selector_string
from iterserve.operator.conditions import AUTOSCALING, DEGRADED, PROGRESSING, READY, TUNED, get_condition, set_condition
from iterserve.operator.spec import camel

TUNING_OFF_MESSAGE = "spec.tuning.mode is off: knobs stay at spec.engine"


@dataclass
class ReconcileResult:
    """What one reconcile saw and did, the input of `compute_status`."""

    name: str
    generation: int
    replicas_wanted: int | None = None  # None: the spec is invalid
    autoscaling: bool = False  # spec.autoscaling is set (its condition and lastScale stay)
    tuning_mode: str | None = None
    deployment: dict | None = None
    router_replicas: int | None = None  # spec.router.replicas while the router is on, else None
    router: dict | None = None  # the router's Deployment
    knobs: dict[str, int] | None = None  # in force (ConfigMap)
    spec_error: str | None = None
    problems: list[str] = field(default_factory=list)  # children or pods the operator could not set right


def _rollout(deployment: dict, wanted: int) -> tuple[bool, str]:
    """(still rolling out?, message) from a Deployment's status."""
    status = deployment.get("status") or {}
    generation = (deployment.get("metadata") or {}).get("generation", 0)
    updated = status.get("updatedReplicas", 0)
    total = status.get("replicas", 0)
    available = status.get("availableReplicas", 0)
    if status.get("observedGeneration", 0) < generation:
        return True, "the Deployment controller has not seen the latest template yet"
    if updated < wanted:
        return True, f"{updated}/{wanted} replicas updated"
    if total > updated:
        return True, f"{total - updated} old replicas terminating"
    if available < wanted:
        return True, f"{available}/{wanted} replicas available"
    return False, f"{wanted} replicas up to date"


def _ready(deployment: dict | None) -> int:
    return ((deployment or {}).get("status") or {}).get("readyReplicas", 0)


def _deployment_failure(deployment: dict | None) -> str | None:
    for condition in (deployment or {}).get("status", {}).get("conditions") or ():
        if condition.get("type") == "Progressing" and condition.get("reason") == "ProgressDeadlineExceeded":
            return f"rollout stuck: {condition.get('message', '')}".strip()
        if condition.get("type") == "ReplicaFailure" and condition.get("status") == "True":
            return f"{condition.get('reason', 'ReplicaFailure')}: {condition.get('message', '')}"
    return None


def compute_status(obs: ReconcileResult, current: dict | None, now: str) -> dict:
    """The whole operator-owned part of the status (to merge into `current`, the status as read)."""
    current = current or {}
    conditions = list(current.get("conditions") or [])
    # never backwards: a writer holding an older view of the object (a stale read, a replica that has
    # just lost the Lease) must not undo what a newer pass recorded; kubectl wait, Argo CD and Flux
    # read observedGeneration < generation as "the spec was not processed"
    gen = max(obs.generation, current.get("observedGeneration") or 0)

    def put(type_, status, reason, message):
        nonlocal conditions
        conditions = set_condition(conditions, type_, status, reason, message, observed_generation=gen, now=now)

    dep_status = (obs.deployment or {}).get("status") or {}
    ready = _ready(obs.deployment)
    wanted = obs.replicas_wanted
    if wanted is None:
        wanted = (obs.deployment or {}).get("spec", {}).get("replicas", 0)
    if obs.deployment is None:
        put(READY, False, "DeploymentMissing", "the Deployment does not exist (yet)")
    elif wanted == 0:
        put(READY, False, "ScaledToZero", "spec.replicas is 0")
    elif ready < wanted:
        put(READY, False, "ReplicasNotReady", f"{ready}/{wanted} replicas ready")
    elif obs.router_replicas is not None and obs.router is None:
        put(READY, False, "RouterMissing", f"{ready}/{wanted} replicas ready; the router's Deployment does not "
            "exist (yet)")
    elif obs.router_replicas is not None and _ready(obs.router) < obs.router_replicas:
        put(READY, False, "RouterNotReady", f"{ready}/{wanted} replicas ready; router "
            f"{_ready(obs.router)}/{obs.router_replicas} ready")
    else:
        router = "" if obs.router_replicas is None else f", router {_ready(obs.router)}/{obs.router_replicas}"
        put(READY, True, "AllReplicasReady", f"{ready}/{wanted} replicas ready{router}")

    if obs.spec_error is not None:
        put(PROGRESSING, False, "InvalidSpec", "the spec is not applied until it is fixed")
    elif obs.deployment is None:
        put(PROGRESSING, True, "Creating", "creating the Deployment")
    else:
        rolling, message = _rollout(obs.deployment, wanted)
        put(PROGRESSING, rolling, "RollingOut" if rolling else "RolloutComplete", message)

    failure = _deployment_failure(obs.deployment)
    if obs.spec_error is not None:
        put(DEGRADED, True, "InvalidSpec", obs.spec_error)
    elif obs.problems:
        put(DEGRADED, True, "ReconcileFailed", "; ".join(obs.problems))
    elif failure is not None:
        put(DEGRADED, True, "RolloutFailed", failure)
    else:
        put(DEGRADED, False, "AsExpected", "")

    if obs.tuning_mode == "off":
        put(TUNED, False, "TuningOff", TUNING_OFF_MESSAGE)
    elif obs.tuning_mode is not None and get_condition(conditions, TUNED) is None:
        put(TUNED, None, "WaitingForMetrics", f"tuning mode {obs.tuning_mode}: no decision yet")

    if obs.replicas_wanted is not None and not obs.autoscaling:  # what the autoscaler said no longer holds
        conditions = [c for c in conditions if c.get("type") != AUTOSCALING]

    status = {
        "observedGeneration": gen,
        "replicas": dep_status.get("replicas", 0),
        "readyReplicas": ready,
        "updatedReplicas": dep_status.get("updatedReplicas", 0),
        "selector": selector_string(obs.name),
        "conditions": conditions,
    }
    if obs.replicas_wanted is not None and not obs.autoscaling:  # with spec.autoscaling, the autoscaler's
        status["desiredReplicas"] = wanted
        status["lastScale"] = None
    if obs.knobs is not None:
        status["knobs"] = {camel(k): v for k, v in obs.knobs.items()}
    return status
