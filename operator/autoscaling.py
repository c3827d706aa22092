"""spec.autoscaling in the operator's terms (pure): the replicas in force, the other autoscalers that
target the same service, the scaler's policy and what one tick of the tuner tells it.

With spec.autoscaling the operator owns the replica count: the autoscaler keeps it in status.desiredReplicas
(the reconcile leaves that field to it), which the reconcile renders into the Deployment (clamped into [minReplicas,
maxReplicas], so a range edit holds at
once), and spec.replicas is only where a new service starts. Without it, the replicas are spec.replicas,
which the CRD's scale subresource lets an HPA or KEDA set.
"""

from __future__ import annotations

import dataclasses

from iterserve.operator.constants import GROUP, KIND
from iterserve.operator.spec import LLMService
from iterserve.operator.tuning.policy import TuningPolicy
from iterserve.operator.tuning.reading import read
from iterserve.operator.tuning.scale import Fleet, ScalePolicy
from iterserve.operator.tuning.tuner import TuningRecord

HPA_API = "autoscaling/v1"  # served by every Kubernetes version; scaleTargetRef is the same in v2


def autoscaled_replicas(svc: LLMService, status: dict | None) -> int:
    """The autoscaler's count as it stands (status.desiredReplicas; spec.replicas until it has one), before
    the range: the autoscaler itself brings it inside, saying why."""
    desired = (status or {}).get("desiredReplicas")
    return svc.replicas if isinstance(desired, bool) or not isinstance(desired, int) else desired


def replicas_in_force(svc: LLMService, status: dict | None) -> int:
    """The replicas the Deployment should run: spec.replicas, or with spec.autoscaling the autoscaler's
    count inside [minReplicas, maxReplicas] (a range edit holds before the autoscaler's next tick)."""
    a = svc.autoscaling
    if a is None:
        return svc.replicas
    return min(max(autoscaled_replicas(svc, status), a.min_replicas), a.max_replicas)


def with_replicas_in_force(svc: LLMService, status: dict | None) -> LLMService:
    """`svc` with `replicas` set to the replicas in force, which every builder (Deployment, PDB) renders."""
    replicas = replicas_in_force(svc, status)
    return svc if replicas == svc.replicas else dataclasses.replace(svc, replicas=replicas)


def targets(hpa: dict, svc: LLMService) -> bool:
    """Whether a HorizontalPodAutoscaler (KEDA's included: a ScaledObject makes one) scales this service,
    through the LLMService's scale subresource or its Deployment's (which has the service's name)."""
    ref = (hpa.get("spec") or {}).get("scaleTargetRef") or {}
    if ref.get("name") != svc.name:
        return False
    api = ref.get("apiVersion") or ""
    return (ref.get("kind") == KIND and api.startswith(GROUP + "/")) or \
        (ref.get("kind") == "Deployment" and api in ("apps/v1", ""))


def conflicting_hpas(hpas: list[dict], svc: LLMService) -> tuple[str, ...]:
    return tuple(sorted(h["metadata"]["name"] for h in hpas if targets(h, svc)))


def scale_policy(svc: LLMService, tuning: TuningPolicy) -> ScalePolicy:
    """The scaler's policy: the spec's range and windows; it settles over the tuner's window and calls
    headroom what the tuner does."""
    a = svc.autoscaling
    assert a is not None  # the scaler runs only for services with spec.autoscaling
    return ScalePolicy(min_replicas=a.min_replicas, max_replicas=a.max_replicas,
                       scale_up_window_s=float(a.scale_up_stabilization_seconds),
                       scale_down_window_s=float(a.scale_down_stabilization_seconds),
                       settle_s=tuning.window_s, window_s=tuning.window_s, headroom_line=tuning.headroom_line)


def fleet_of(record: TuningRecord, tuning: TuningPolicy, replicas: int, ready: int,
             conflicts: tuple[str, ...]) -> Fleet:
    """What the scaler reads from one tuner tick: its window (judged only with enough samples, as the
    tuner judges it), its verdict and action, the batch cap in force."""
    obs = record.observation
    reading = read(obs, tuning) if obs is not None and obs.num_samples >= tuning.min_samples else None
    return Fleet(replicas=replicas, ready=ready, obs=obs, reading=reading, verdict=record.decision.tuned,
                 tuner_action=record.decision.action, knobs_fixed=tuning.mode != "auto",
                 batch_cap=record.knobs.max_num_seqs, knobs=record.knobs, conflicts=conflicts)
