"""How a child as stored differs from what the operator renders, and whose it is (pure)."""

from __future__ import annotations

from iterserve.operator.builders.labels import MANAGED_BY


def differences(desired, actual, path: str = "", limit: int = 8) -> list[str]:
    """Paths where `actual` lacks or differs from a value `desired` sets (fields only `actual` has are
    ignored: the API server adds defaults and status). Quantities are compared as the server stores
    them, so render them canonically (e.g. "500m", "2Gi")."""
    found: list[str] = []
    _walk(desired, actual, path, found, limit)
    return found


def _walk(desired, actual, path: str, found: list[str], limit: int) -> None:
    if len(found) >= limit:
        return
    if isinstance(desired, dict) and isinstance(actual, dict):
        for key, value in desired.items():
            _walk(value, actual.get(key), f"{path}.{key}" if path else key, found, limit)
    elif isinstance(desired, list) and isinstance(actual, list) and len(desired) == len(actual):
        for i, (d, a) in enumerate(zip(desired, actual, strict=True)):
            _walk(d, a, f"{path}[{i}]", found, limit)
    elif desired != actual and not _same_number(desired, actual):
        found.append(path)


def _same_number(a, b) -> bool:
    # the API returns an int-or-string quantity 1 as 1 or "1" depending on how it was written
    return isinstance(a, (int, str)) and isinstance(b, (int, str)) and str(a) == str(b)


def foreign_owner(obj: dict, owner_uid: str) -> str | None:
    """Why `obj` (an existing object with a child's name) is not this LLMService's to manage, or None.

    Ours: controlled by this LLMService, or carrying our managed-by label with no other controller
    (e.g. left behind by an LLMService deleted with --cascade=orphan)."""
    meta = obj.get("metadata") or {}
    controller = next((ref for ref in meta.get("ownerReferences") or () if ref.get("controller")), None)
    if controller is not None:
        if controller.get("uid") == owner_uid:
            return None
        return f"it is controlled by {controller.get('kind')} {controller.get('name')}"
    if (meta.get("labels") or {}).get("app.kubernetes.io/managed-by") == MANAGED_BY:
        return None
    return "it exists and was not created by the operator"
