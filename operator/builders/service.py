"""The Service `<name>` clients use (port 8000, named http): in front of the server pods in rotation, or of
the router's pods while spec.router is on and a router pod is ready (the router reaches every server pod
through `<name>-pods`). Switching only once a router pod is ready, and back while none is, keeps
clients served while the router starts, stops or fails. A server pod is in rotation unless the operator
has taken it out while its queue drains (tuning/rotation.py): the pod template labels every pod in."""

from __future__ import annotations

from iterserve.operator.builders.labels import (
    HTTP_PORT,
    IN_ROTATION,
    ROTATION_LABEL,
    child_metadata,
    router_selector_labels,
    selector_labels,
)
from iterserve.operator.spec import LLMService


def build_service(svc: LLMService, to_router: bool = False) -> dict:
    # server-side apply replaces the selector whole (a map the API server treats as atomic)
    selector = router_selector_labels(svc.name) if to_router else {**selector_labels(svc.name),
                                                                     ROTATION_LABEL: IN_ROTATION}
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
