"""Names, labels and owner references shared by every child of an LLMService."""

from __future__ import annotations

from iterserve.common import wire
from iterserve.operator.constants import GROUP, KIND, VERSION
from iterserve.operator.spec import LLMService

MANAGED_BY = "iterserve-operator"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"  # its key, on every child the operator makes
HTTP_PORT = wire.HTTP_PORT
ADMIN_PORT = wire.ADMIN_PORT  # /admin/* only (`iterserve serve --admin-port`), reachable from the operator alone
ADMIN_PORT_NAME = "admin"
ANNOTATION_PREFIX = "iterserve.io/"
# the Service sends new requests to the server pods labelled `in` (the pod template's value); the operator
# relabels a backlogged pod `out` while its peers catch up (tuning/rotation.py)
ROTATION_LABEL = ANNOTATION_PREFIX + "rotation"
IN_ROTATION, OUT_OF_ROTATION = "in", "out"


def knobs_configmap_name(name: str) -> str:
    return f"{name}-knobs"


def selector_labels(name: str) -> dict[str, str]:
    """What selects the pods of one LLMService (Deployment, Service, PDB, status.selector)."""
    return {"app.kubernetes.io/name": "iterserve", "app.kubernetes.io/instance": name}


def selector_string(name: str) -> str:
    return ",".join(f"{key}={value}" for key, value in selector_labels(name).items())


def labels(name: str) -> dict[str, str]:
    return {**selector_labels(name), "app.kubernetes.io/component": "server",
            MANAGED_BY_LABEL: MANAGED_BY}


def pod_labels(name: str) -> dict[str, str]:
    """The server pod template's labels: `labels` and the rotation's starting value."""
    return {**labels(name), ROTATION_LABEL: IN_ROTATION}


def router_name(name: str) -> str:
    """The router's Deployment (and its NetworkPolicy)."""
    return f"{name}-router"


def pods_service_name(name: str) -> str:
    """The headless Service whose DNS name resolves to the ready server pods, for the router."""
    return f"{name}-pods"


def router_selector_labels(name: str) -> dict[str, str]:
    """What selects the router's pods: the keys of `selector_labels` with a different name, so that nothing
    selecting the server pods (their Deployment, the PDB, the tuner's pod list, status.selector) ever takes
    a router pod (the Service `<name>` switches selectors whole: an apply replaces an atomic map)."""
    return {"app.kubernetes.io/name": "iterserve-router", "app.kubernetes.io/instance": name}


def router_labels(name: str) -> dict[str, str]:
    return {**router_selector_labels(name), "app.kubernetes.io/component": "router",
            MANAGED_BY_LABEL: MANAGED_BY}


def owner_reference(svc: LLMService) -> dict:
    # blockOwnerDeletion: foreground deletion of the LLMService waits for its children
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": svc.name, "uid": svc.uid,
            "controller": True, "blockOwnerDeletion": True}


def child_metadata(svc: LLMService, name: str, annotations: dict[str, str] | None = None,
                   child_labels: dict[str, str] | None = None) -> dict:
    meta = {"name": name, "namespace": svc.namespace, "labels": child_labels or labels(svc.name),
            "ownerReferences": [owner_reference(svc)]}
    if annotations:
        meta["annotations"] = annotations
    return meta
