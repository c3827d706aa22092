"""How a child as stored differs from what the operator renders, and whose it is (pure)."""

from __future__ import annotations

import hashlib
import json

from iterserve.operator.builders.labels import ANNOTATION_PREFIX, MANAGED_BY, MANAGED_BY_LABEL

# On every child the operator server-side applies: a digest of what it applied. A rendering that drops a
# field (an annotation, a resource limit) leaves no difference `differences` can see in the stored
# object, but it changes the digest, so the apply that removes the field still happens.
APPLIED_DIGEST_ANNOTATION = ANNOTATION_PREFIX + "applied-digest"
# Fields the API server replaces whole on an apply (atomic maps and label selectors): a key someone
# added there is drift too, and `differences` alone, which ignores keys only the stored object has,
# would not see it.
ATOMIC_PATHS = (("spec", "selector"), ("spec", "podSelector"))


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


def with_applied_digest(desired: dict) -> dict:
    """`desired` carrying the digest of itself (without the digest) in APPLIED_DIGEST_ANNOTATION."""
    meta = desired["metadata"]
    annotations = {k: v for k, v in (meta.get("annotations") or {}).items() if k != APPLIED_DIGEST_ANNOTATION}
    bare = {**desired, "metadata": {**meta, "annotations": annotations}}
    if not annotations:
        del bare["metadata"]["annotations"]
    digest = hashlib.sha256(json.dumps(bare, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]
    return {**desired, "metadata": {**meta, "annotations": {**annotations, APPLIED_DIGEST_ANNOTATION: digest}}}


def apply_needed(desired: dict, actual: dict | None) -> list[str]:
    """Why a server-side apply of `desired` (stamped by `with_applied_digest`) would change `actual`, the
    child as stored: the paths that drifted or changed, none when the apply can be skipped. ["(missing)"]
    when there is no child."""
    if actual is None:
        return ["(missing)"]
    found = differences(desired, actual)
    for path in ATOMIC_PATHS:
        want, have = _at(desired, path), _at(actual, path)
        key = ".".join(path)
        if want is not None and want != have and key not in found:
            found.append(key)
    return found


def _at(obj, path: tuple[str, ...]):
    for key in path:
        obj = obj.get(key) if isinstance(obj, dict) else None
    return obj


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
    if (meta.get("labels") or {}).get(MANAGED_BY_LABEL) == MANAGED_BY:
        return None
    return "it exists and was not created by the operator"
