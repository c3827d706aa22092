"""The Secret `<name>-admin` holding the admin token the operator uses for PATCH /admin/scheduler."""

from __future__ import annotations

import base64
import hashlib
import secrets

from iterserve.operator.builders.labels import admin_secret_name, child_metadata
from iterserve.operator.spec import LLMService

TOKEN_KEY = "token"


def new_admin_token() -> str:
    return secrets.token_urlsafe(32)


def build_admin_secret(svc: LLMService, token: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": child_metadata(svc, admin_secret_name(svc.name)),
        "type": "Opaque",
        "data": {TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }


def admin_token_of(secret: dict | None) -> str | None:
    """The token stored in an admin Secret as the API returns it; None when missing or empty."""
    encoded = ((secret or {}).get("data") or {}).get(TOKEN_KEY)
    if not encoded:
        return None
    try:
        return base64.b64decode(encoded).decode() or None
    except (ValueError, UnicodeDecodeError):
        return None


def token_digest(token: str) -> str:
    """A short fingerprint for the pod template: a new token rolls the pods so they read it (never the token)."""
    return hashlib.sha256(token.encode()).hexdigest()[:16]
