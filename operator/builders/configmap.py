"""ConfigMap `<name>-knobs`: the live knobs in force, read by pods at start through env vars (pure).

Running pods get every change through PATCH /admin/scheduler, so a knob change never restarts a pod.
The annotation records spec.engine's knobs as the operator last wrote them (see operator/knob_plan.py).
"""

from __future__ import annotations

import json

from iterserve.common import wire
from iterserve.common.wire import KNOB_NAMES
from iterserve.operator.builders.labels import ANNOTATION_PREFIX, child_metadata, knobs_configmap_name
from iterserve.operator.spec import LLMService

SPEC_KNOBS_ANNOTATION = ANNOTATION_PREFIX + "spec-knobs"


def configmap_key(knob: str) -> str:
    return knob.replace("_", "-")


def env_var(knob: str) -> str:
    return next(k.env for k in wire.KNOBS if k.name == knob)


def knobs_from_configmap(configmap: dict | None) -> dict[str, int] | None:
    """The knobs a ConfigMap holds, or None when it is missing or any value is not a positive integer."""
    data = (configmap or {}).get("data") or {}
    knobs = {}
    for knob in KNOB_NAMES:
        value = data.get(configmap_key(knob), "")
        if not value.isdigit() or int(value) < 1:
            return None
        knobs[knob] = int(value)
    return knobs


def spec_knobs_recorded(configmap: dict | None) -> dict[str, int] | None:
    """spec.engine's knobs as they were when the operator last wrote the ConfigMap."""
    raw = (((configmap or {}).get("metadata") or {}).get("annotations") or {}).get(SPEC_KNOBS_ANNOTATION)
    try:
        recorded = json.loads(raw) if raw else None
    except ValueError:
        return None
    return recorded if isinstance(recorded, dict) else None


def build_knobs_configmap(svc: LLMService, knobs: dict[str, int], spec_knobs: dict[str, int] | None = None) -> dict:
    """`spec_knobs`: what to record as spec.engine's knobs (default: the current spec's)."""
    recorded = json.dumps(spec_knobs or svc.engine.knobs, sort_keys=True, separators=(",", ":"))
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": child_metadata(svc, knobs_configmap_name(svc.name), {SPEC_KNOBS_ANNOTATION: recorded}),
        "data": {configmap_key(knob): str(knobs[knob]) for knob in KNOB_NAMES},
    }
