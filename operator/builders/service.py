"""The Service `<name>` clients use (port 8000, named http): in front of the server pods, or of the
router's pods while spec.router is on and a router pod is ready (the router reaches the server pods
through `<name>-pods`). Switching only once a router pod is ready, and back while none is, keeps
clients served while the router starts, stops or fails."""

from __future__ import annotations

from iterserve.operator.builders.labels import HTTP_PORT, child_metadata, router_selector_labels, selector_labels
from iterserve.operator.spec import LLMService


def build_service(svc: LLMService, to_router: bool = False) -> dict:
    # same keys either way, other values: server-side apply replaces the selector whole
    selector = router_selector_labels(svc.name) if to_router else selector_labels(svc.name)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(svc, svc.name),
        "spec": {
            "type": "ClusterIP",
            "selector": selector,
            "ports": [{"name": "http", "port": HTTP_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }
