"""Status conditions (Kubernetes' metav1.Condition shape), replaced by type (pure).

`lastTransitionTime` changes only when a condition's status changes, so it says since when a service
has been Ready, not when the operator last looked.
"""

from __future__ import annotations

import datetime

READY, PROGRESSING, DEGRADED, TUNED = "Ready", "Progressing", "Degraded", "Tuned"
AUTOSCALING = "Autoscaling"  # spec.autoscaling's last word: why the replicas are what they are


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def status_string(value: bool | str | None) -> str:
    if value is None:
        return "Unknown"
    if isinstance(value, bool):
        return "True" if value else "False"
    if value not in ("True", "False", "Unknown"):
        raise ValueError(f"condition status must be True, False or Unknown, got {value!r}")
    return value


def get_condition(conditions: list[dict] | None, type_: str) -> dict | None:
    return next((c for c in conditions or () if c.get("type") == type_), None)


def set_condition(conditions: list[dict] | None, type_: str, status: bool | str | None, reason: str,
                  message: str = "", *, observed_generation: int | None = None, now: str | None = None) -> list[dict]:
    """A new list with condition `type_` set (others kept, in order; a new type goes last)."""
    status = status_string(status)
    old = get_condition(conditions, type_)
    transition = old["lastTransitionTime"] if old and old.get("status") == status and old.get(
        "lastTransitionTime") else (now or now_iso())
    new = {"type": type_, "status": status, "reason": reason, "lastTransitionTime": transition}
    if message:  # omitted when empty: Kubernetes 1.20 refused a status merge patch with "" here as null
        new["message"] = message
    if observed_generation is not None:
        new["observedGeneration"] = observed_generation
    out = [new if c.get("type") == type_ else c for c in conditions or ()]
    if old is None:
        out.append(new)
    return out


def transitions(before: list[dict] | None, after: list[dict] | None) -> list[dict]:
    """Conditions of `after` whose status or reason differs from `before` (worth an Event)."""
    changed = []
    for condition in after or ():
        old = get_condition(before, condition["type"])
        if old is None or (old.get("status"), old.get("reason")) != (condition["status"], condition.get("reason")):
            changed.append(condition)
    return changed
