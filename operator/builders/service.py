"""The Service in front of an LLMService's pods (port 8000, named http)."""

from __future__ import annotations

from iterserve.operator.builders.labels import HTTP_PORT, child_metadata, selector_labels
from iterserve.operator.spec import LLMService


def build_service(svc: LLMService) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(svc, svc.name),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(svc.name),
            "ports": [{"name": "http", "port": HTTP_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }
