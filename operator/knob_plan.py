"""Which scheduler knobs are in force for an LLMService: spec.engine or the tuner's (pure).

The ConfigMap holds the values in force: pods read them at start through env vars, and running pods
get every change through PATCH /admin/scheduler, so a knob change never restarts a pod. Who decides
the values (docs/operator.md, "Live knobs and the tuner"):
- tuning off or observe: spec.engine's values, always (an edit of the ConfigMap is drift and is undone);
- tuning auto: the tuner owns them. spec.engine's values are the starting point; the operator writes
  a knob again only when the user changes that knob in the spec (recorded in the annotation below),
  and pulls values back inside spec.tuning.bounds when the bounds change.
"""

from __future__ import annotations

from dataclasses import dataclass

from iterserve.operator.builders.configmap import knobs_from_configmap, spec_knobs_recorded
from iterserve.operator.spec import LLMService, camel


@dataclass(frozen=True)
class KnobPlan:
    knobs: dict[str, int]  # the values to have in force
    reason: str  # why they differ from the ConfigMap's ("" when they do not)


def describe_change(old: dict[str, int] | None, new: dict[str, int]) -> str:
    if old is None:
        return ", ".join(f"{camel(k)} {v}" for k, v in new.items())
    return ", ".join(f"{camel(k)} {old[k]} -> {v}" for k, v in new.items() if old.get(k) != v)


def plan_knobs(svc: LLMService, configmap: dict | None) -> KnobPlan:
    in_force = knobs_from_configmap(configmap)
    spec = svc.engine.knobs
    if in_force is None:
        return KnobPlan(dict(spec), "initial values from spec.engine")
    if svc.tuning.mode != "auto":
        reason = f"spec.engine (tuning {svc.tuning.mode})" if in_force != spec else ""
        return KnobPlan(dict(spec), reason)
    recorded = spec_knobs_recorded(configmap)
    edited = {k: v for k, v in spec.items() if recorded is not None and recorded.get(k) != v}
    wanted = {**in_force, **edited}
    clamped = {k: svc.tuning.bounds[k].clamp(v) for k, v in wanted.items()}
    reasons = []
    if edited:
        reasons.append("spec.engine changed")
    if clamped != wanted:
        reasons.append("kept within spec.tuning.bounds")
    return KnobPlan(clamped, " and ".join(reasons) if clamped != in_force else "")
