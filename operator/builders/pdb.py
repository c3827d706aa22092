"""The PodDisruptionBudget of an LLMService with more than one replica: drains take one pod at a time."""

from __future__ import annotations

from iterserve.operator.builders.labels import child_metadata, selector_labels
from iterserve.operator.spec import LLMService


def build_pdb(svc: LLMService, api_version: str = "policy/v1") -> dict | None:
    """None when replicas <= 1: a budget over one pod would block every node drain.

    `api_version` is policy/v1 (Kubernetes >= 1.21) or policy/v1beta1 on older servers; the spec is the same.
    """
    if svc.replicas <= 1:
        return None
    return {
        "apiVersion": api_version,
        "kind": "PodDisruptionBudget",
        "metadata": child_metadata(svc, svc.name),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(svc.name)}},
    }
