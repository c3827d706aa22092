"""The replica autoscaler inside the tuner's loop: one `Autoscaler` per LLMService with spec.autoscaling.

It runs right after each tuner tick (operator/tuning_loop.py), under the same object lock, on the same
window: the replicas in force (operator/autoscaling.py), the Deployment's ready pods and the namespace's
HorizontalPodAutoscalers go into `decide_scale` (operator/tuning/scale.py); its count and reason go to the
status (desiredReplicas, lastScale, the `Autoscaling` condition); a change is then rendered by a full
reconcile, which reads desiredReplicas back and applies the Deployment (and the PodDisruptionBudget) with
it, so there is one way the Deployment is written. The Events name each change and each turn of the
condition into or out of trouble. Before the tuner's tick, it tells the tuner whether pods its last
scale-out added are still coming up (operator/tuning/fleet_change.py); before the tuner applies a move,
`decide` says whether the fleet grows on it (`fleet_change.second_look`), the scaler's state untouched.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from iterserve.operator import controller
from iterserve.operator.autoscaling import HPA_API, autoscaled_replicas, conflicting_hpas, fleet_of, scale_policy
from iterserve.operator.conditions import AUTOSCALING, set_condition
from iterserve.operator.kube import Kube
from iterserve.operator.spec import LLMService
from iterserve.operator.tuning.fleet_change import ScaleOut, scale_out_in_flight
from iterserve.operator.tuning.policy import TuningPolicy
from iterserve.operator.tuning.scale import SCALE_OUT, STAY, ScaleDecision, ScaleState, decide_scale
from iterserve.operator.tuning.tuner import TuningRecord, rfc3339

logger = logging.getLogger("iterserve.operator.autoscaling")
QUIET_REASONS = ("ScaledOut", "ScaledIn")  # their change Event says it; no second one for the condition


def scale_event(decision: ScaleDecision) -> dict | None:
    if decision.action == STAY:
        return None
    return {"type": "Normal", "reason": "ScaledOut" if decision.action == SCALE_OUT else "ScaledIn",
            "message": decision.reason}


def status_fields(decision: ScaleDecision, before: int, now: float) -> dict:
    fields: dict[str, Any] = {"desiredReplicas": decision.replicas}
    if decision.action != STAY:
        fields["lastScale"] = {"from": before, "to": decision.replicas, "reason": decision.reason,
                               "time": rfc3339(now)}
    return fields


@dataclass(frozen=True)
class Replicas:
    """The replicas the autoscaler has asked for and the Deployment's ready pods, read once a tick."""

    desired: int
    ready: int


def replicas_of(kube: Kube, svc: LLMService, status: dict | None) -> Replicas:
    deployment = kube.get("apps/v1", "Deployment", svc.namespace, svc.name) or {}
    return Replicas(autoscaled_replicas(svc, status), (deployment.get("status") or {}).get("readyReplicas") or 0)


@dataclass
class Autoscaler:
    """One service's scaler state and the condition last announced."""

    state: ScaleState = field(default_factory=ScaleState)
    said: tuple[str, str] | None = None

    def scale_out_in_flight(self, svc: LLMService, seen: Replicas, tuning: TuningPolicy,
                            now: float | None = None) -> ScaleOut | None:
        """What this scaler's last scale-out waits for, told to the tuner before its tick; None: nothing."""
        return scale_out_in_flight(self.state, seen.desired, seen.ready, scale_policy(svc, tuning),
                                   time.time() if now is None else now)

    @staticmethod
    def conflicts(kube: Kube, svc: LLMService) -> tuple[str, ...]:
        """The HorizontalPodAutoscalers that target the service too, read once a tick."""
        return conflicting_hpas(kube.list(HPA_API, "HorizontalPodAutoscaler", svc.namespace), svc)

    def decide(self, svc: LLMService, seen: Replicas, record: TuningRecord, tuning: TuningPolicy,
               conflicts: tuple[str, ...]) -> ScaleDecision:
        """What this scaler decides on the tuner's `record` (pure: its state is kept as it is)."""
        return decide_scale(self.state, fleet_of(record, tuning, seen.desired, seen.ready, conflicts),
                            scale_policy(svc, tuning), record.time)

    def tick(self, kube: Kube, svc: LLMService, seen: Replicas, record: TuningRecord, tuning: TuningPolicy,
             conflicts: tuple[str, ...]) -> list[dict]:
        """Decide, write the status and, on a change, reconcile; returns the Events to emit."""
        ns, name, now = svc.namespace, svc.name, record.time
        replicas = seen.desired
        decision = self.decide(svc, seen, record, tuning, conflicts)
        self.state = decision.state
        c = decision.condition
        fields = status_fields(decision, replicas, now)

        def compute(before: dict) -> dict:
            return {**fields, "conditions": set_condition(
                before.get("conditions"), AUTOSCALING, c.status, c.reason, c.message,
                observed_generation=before.get("observedGeneration"))}

        if controller.patch_status(kube, ns, name, compute) is None:
            return []  # deleted meanwhile
        events = []
        if (event := scale_event(decision)) is not None:
            logger.info("%s/%s: %s", ns, name, decision.reason)
            result = controller.handle(kube, {"metadata": {"namespace": ns, "name": name, "uid": svc.uid}})
            if result.problems:
                logger.warning("%s/%s: applying %d replicas: %s", ns, name, decision.replicas,
                               "; ".join(result.problems))
            events.append(event)
        if (c.status, c.reason) != self.said:
            self.said = (c.status, c.reason)
            if c.reason not in QUIET_REASONS:
                events.append({"type": "Normal" if c.status == "True" else "Warning", "reason": c.reason,
                               "message": f"{AUTOSCALING}={c.status}: {c.message}"})
        return events
