"""The admin tokens of a namespace's LLMServices: one Secret, `iterserve-admin-tokens`, one key per
LLMService (its name), so that RBAC can limit the operator's get and patch on Secrets to that one name
(`resourceNames` takes no patterns; per-service names could not be listed in a Role).

Every LLMService with a key is an owner of the Secret (not its controller): garbage collection removes
the owner reference of a deleted LLMService, and the Secret with the last one. A key whose LLMService no
longer owns the Secret is dropped at the next write. Pure functions; operator/reconcile.py writes them.
"""

from __future__ import annotations

import base64
import hashlib
import secrets
from typing import Any

from iterserve.operator.builders.labels import MANAGED_BY, MANAGED_BY_LABEL
from iterserve.operator.constants import GROUP, KIND, VERSION
from iterserve.operator.spec import ADMIN_SECRET, LLMService

SECRET_LABELS = {"app.kubernetes.io/name": "iterserve", "app.kubernetes.io/component": "admin-tokens",
                 MANAGED_BY_LABEL: MANAGED_BY}


def new_admin_token() -> str:
    return secrets.token_urlsafe(32)


def _encode(token: str) -> str:
    return base64.b64encode(token.encode()).decode()


def owner_ref(svc: LLMService) -> dict:
    # not a controller (the Secret is shared) and blocking no foreground deletion of its owners
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": svc.name, "uid": svc.uid,
            "controller": False, "blockOwnerDeletion": False}


def build_admin_secret(svc: LLMService, token: str) -> dict:
    """The Secret as the first LLMService of a namespace creates it."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": ADMIN_SECRET, "namespace": svc.namespace, "labels": dict(SECRET_LABELS),
                     "ownerReferences": [owner_ref(svc)]},
        "type": "Opaque",
        "data": {svc.name: _encode(token)},
    }


def admin_secret_patch(current: dict, svc: LLMService, token: str) -> dict | None:
    """The merge patch (guarded by `current`'s resourceVersion) that makes the stored Secret hold `token`
    under svc's key with svc among its owners and our labels, and drops the keys of LLMServices no longer
    among them; None when nothing needs to change."""
    meta = current.get("metadata") or {}
    mine = owner_ref(svc)
    refs = [mine if ref.get("uid") == svc.uid else ref for ref in meta.get("ownerReferences") or ()]
    if mine not in refs:
        refs.append(mine)  # in place otherwise: services sharing the Secret must not reorder it in turns
    owners = {ref.get("name") for ref in refs if ref.get("kind") == KIND}
    data = current.get("data") or {}
    changes: dict[str, str | None] = {key: None for key in data if key not in owners}
    if data.get(svc.name) != _encode(token):
        changes[svc.name] = _encode(token)
    labels = {**(meta.get("labels") or {}), **SECRET_LABELS}
    if not changes and labels == meta.get("labels") and refs == list(meta.get("ownerReferences") or ()):
        return None
    patch: dict[str, Any] = {"metadata": {"resourceVersion": meta.get("resourceVersion"), "labels": labels,
                                          "ownerReferences": refs}}
    if changes:
        patch["data"] = changes
    return patch


def admin_token_of(secret: dict | None, name: str) -> str | None:
    """LLMService `name`'s token in the admin Secret as the API returns it; None when missing or empty."""
    encoded = ((secret or {}).get("data") or {}).get(name)
    if not encoded:
        return None
    try:
        return base64.b64decode(encoded).decode() or None
    except (ValueError, UnicodeDecodeError):
        return None


def token_digest(token: str) -> str:
    """A short fingerprint for the pod template: a new token rolls the pods so they read it (never the token)."""
    return hashlib.sha256(token.encode()).hexdigest()[:16]
