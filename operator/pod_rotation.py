"""Rotation on the pods: the label the Service `<name>` selects server pods by (builders/labels.py), written
by the operator. The tuning loop's `rotate` takes the pods whose queue stands out of rotation and puts the
others back (tuning/rotation.py decides); the reconcile's `ensure_rotation_labels` labels `in` every pod
that has no label yet (pods from before the label: the Service's selector needs it) and, where rotation
is not active (tuning not `auto`, or spec.router on), every pod left `out`, so that turning it off never
leaves a pod without traffic."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from iterserve.operator.builders.labels import IN_ROTATION, OUT_OF_ROTATION, ROTATION_LABEL
from iterserve.operator.kube import Kube
from iterserve.operator.spec import LLMService
from iterserve.operator.tuning.rotation import out_of_rotation, rotation_active, rotation_gap

logger = logging.getLogger("iterserve.operator")


def rotation_of(pod: dict) -> str | None:
    return (pod["metadata"].get("labels") or {}).get(ROTATION_LABEL)


def set_rotation(kube: Kube, pod: dict, value: str) -> bool:
    """Label `pod` `value` unless it is already; True when it was changed."""
    if rotation_of(pod) == value:
        return False
    meta = pod["metadata"]
    kube.merge_patch("v1", "Pod", meta["namespace"], meta["name"], {"metadata": {"labels": {ROTATION_LABEL: value}}})
    return True


def rotate(kube: Kube, svc: LLMService, pods: Mapping[str, dict], waiting: Mapping[str, float],
           per_pod_rate: float, interval_s: float) -> tuple[frozenset[str], list[str]]:
    """One tick of rotation over the ready `pods` (by URL) with each read pod's requests waiting now
    (`waiting`; a pod not read is put in: without a reading it is a plain endpoint), the fleet's
    completions per pod over the window and the tick. Returns the pods out now and what changed, one
    `<pod> in|out (...)` each."""
    active = rotation_active(svc.tuning.mode, svc.router.enabled)
    gap = rotation_gap(per_pod_rate, interval_s)
    out = out_of_rotation({u: w for u, w in waiting.items() if u in pods}, gap) if active else frozenset()
    lo = min(waiting.values(), default=0.0)
    changes = []
    for url, pod in pods.items():
        value = OUT_OF_ROTATION if url in out else IN_ROTATION
        if set_rotation(kube, pod, value):
            why = (f"{waiting[url]:.0f} waiting, the shortest queue {lo:.0f}, the gap {gap:.0f}" if url in waiting
                   else "not read")
            changes.append(f"{pod['metadata']['name']} {value} ({why if active else 'rotation off'})")
    if changes:
        logger.info("%s/%s: rotation: %s", svc.namespace, svc.name, "; ".join(changes))
    return out, changes


def ensure_rotation_labels(kube: Kube, svc: LLMService, pods: Iterable[dict]) -> list[str]:
    """The reconcile's part (see the module's docstring): the names of the pods labelled `in`."""
    active = rotation_active(svc.tuning.mode, svc.router.enabled)
    changed = []
    for pod in pods:
        label = rotation_of(pod)
        if pod["metadata"].get("deletionTimestamp") or label == IN_ROTATION or (label == OUT_OF_ROTATION and active):
            continue
        set_rotation(kube, pod, IN_ROTATION)
        changed.append(pod["metadata"]["name"])
    return changed
