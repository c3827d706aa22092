"""The namespace's admin-token Secret (one key per LLMService, each LLMService an owner): what the first
service creates, and the merge patch that brings a stored Secret in line for one service, for a table of
stored states."""

from __future__ import annotations

import base64
import dataclasses

import pytest

from iterserve.operator.builders.secret import (
    ADMIN_SECRET,
    SECRET_LABELS,
    admin_secret_patch,
    admin_token_of,
    build_admin_secret,
    owner_ref,
)
from tests.test_operator_builders import KUBE_VERSIONS, UID, service, validate

CHAT, OTHER = service({}), dataclasses.replace(service({}, name="other"), uid="uid-of-other")
OTHER_REF = owner_ref(OTHER)
OLD_CHAT_REF = {**owner_ref(CHAT), "uid": "uid-of-a-deleted-chat"}


def enc(token: str) -> str:
    return base64.b64encode(token.encode()).decode()


def stored(data: dict, refs: list, labels: dict | None = None) -> dict:
    return {"metadata": {"name": ADMIN_SECRET, "namespace": "team-a", "resourceVersion": "7",
                         "labels": SECRET_LABELS if labels is None else labels, "ownerReferences": refs},
            "data": data}


def meta(refs: list, labels: dict | None = None) -> dict:
    return {"resourceVersion": "7", "labels": labels or SECRET_LABELS, "ownerReferences": refs}


CASES = {
    "in line": (stored({"chat": enc("t")}, [owner_ref(CHAT)]), "t", None),
    "in line among others, order kept": (
        stored({"other": enc("o"), "chat": enc("t")}, [owner_ref(CHAT), OTHER_REF]), "t", None),
    "first write for chat": (
        stored({"other": enc("o")}, [OTHER_REF]), "t",
        {"metadata": meta([OTHER_REF, owner_ref(CHAT)]), "data": {"chat": enc("t")}}),
    "key of a deleted service whose reference garbage collection removed": (
        stored({"chat": enc("t"), "gone": enc("g")}, [owner_ref(CHAT)]), "t",
        {"metadata": meta([owner_ref(CHAT)]), "data": {"gone": None}}),
    "chat recreated under the same name: its old token kept": (
        stored({"chat": enc("t")}, [OLD_CHAT_REF]), "t",
        {"metadata": meta([OLD_CHAT_REF, owner_ref(CHAT)])}),
    "a new token (the key was removed)": (
        stored({}, [owner_ref(CHAT)]), "new",
        {"metadata": meta([owner_ref(CHAT)]), "data": {"chat": enc("new")}}),
    "labels put back, others' kept": (
        stored({"chat": enc("t")}, [owner_ref(CHAT)], {"app.kubernetes.io/managed-by": "iterserve-operator",
                                                       "team": "a"}), "t",
        {"metadata": meta([owner_ref(CHAT)], {"app.kubernetes.io/managed-by": "iterserve-operator", "team": "a",
                                              **SECRET_LABELS})}),
}


@pytest.mark.parametrize("case", CASES)
def test_admin_secret_patch(case):
    current, token, patch = CASES[case]
    assert admin_secret_patch(current, CHAT, token) == patch


def test_applying_the_patch_gives_a_stored_secret_in_line():
    current = stored({"other": enc("o"), "gone": enc("g")}, [OTHER_REF])
    patch = admin_secret_patch(current, CHAT, "t")
    merged = {"metadata": {**current["metadata"], **patch["metadata"]},
              "data": {k: v for k, v in {**current["data"], **patch["data"]}.items() if v is not None}}
    assert merged["data"] == {"other": enc("o"), "chat": enc("t")}
    assert admin_secret_patch(merged, CHAT, "t") is None and admin_secret_patch(merged, OTHER, "o") is None
    assert admin_token_of(merged, "chat") == "t" and admin_token_of(merged, "other") == "o"
    assert admin_token_of(merged, "gone") is None and admin_token_of(None, "chat") is None


def test_created_secret():
    secret = build_admin_secret(CHAT, "s3cret")
    for version in KUBE_VERSIONS:
        validate(secret, version)
    assert secret["metadata"]["name"] == ADMIN_SECRET and secret["metadata"]["labels"] == SECRET_LABELS
    assert secret["metadata"]["ownerReferences"] == [{
        "apiVersion": "iterserve.io/v1alpha1", "kind": "LLMService", "name": "chat", "uid": UID,
        "controller": False, "blockOwnerDeletion": False}]
    assert admin_token_of(secret, "chat") == "s3cret"
    assert admin_secret_patch({**secret, "metadata": {**secret["metadata"], "resourceVersion": "1"}}, CHAT,
                              "s3cret") is None


def test_services_created_together_add_their_tokens_without_running_out_of_retries(kube_cluster, kube_namespace):
    """A fleet applied at once: every pass of the namespace writes the one Secret. On the real API server,
    twelve passes at once each store their token, none ends in "still conflicting"."""
    from concurrent.futures import ThreadPoolExecutor

    from iterserve.operator.kube import Kube
    from iterserve.operator.reconcile import Outcome, ensure_admin_secret
    from iterserve.operator.spec import parse_llmservice
    from tests.operator_support import apply_llmservice

    kube, ns = Kube(kube_cluster.api_client()), kube_namespace
    names = [f"svc-{i}" for i in range(12)]
    for name in names:
        apply_llmservice(kube_cluster, ns, name, {})
    services = [parse_llmservice(kube.get_llmservice(ns, name)) for name in names]
    with ThreadPoolExecutor(len(services)) as pool:
        tokens = list(pool.map(lambda svc: ensure_admin_secret(kube, svc, Outcome()), services))
    stored = kube.get("v1", "Secret", ns, ADMIN_SECRET)
    assert [admin_token_of(stored, name) for name in names] == tokens
    assert len(set(tokens)) == len(names)
    assert {ref["name"] for ref in stored["metadata"]["ownerReferences"]} == set(names)
