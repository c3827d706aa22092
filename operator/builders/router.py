"""spec.router: an `iterserve router` Deployment in front of an LLMService's pods, and the headless
Service it finds them through (pure).

The router discovers the server pods by the DNS name of Service `<name>-pods` (`clusterIP: None`), whose
A records Kubernetes fills with the ready pods alone, so the router needs no API access and no RBAC. The
Service `<name>` (builders/service.py) selects the router's pods instead of the server's while the
router is on, so clients keep one address. The router forwards the client's `Authorization` header
unchanged and the pods check the API key, so the router gets no key of its own.
"""

from __future__ import annotations

from iterserve.operator.builders.deployment import (
    PRESTOP_SLEEP_S,
    SCRAPE_ANNOTATIONS,
    container_resources,
    hardened_container,
    hardened_pod_spec,
    http_probe,
    rolling_deployment,
)
from iterserve.operator.builders.labels import (
    HTTP_PORT,
    child_metadata,
    pods_service_name,
    router_labels,
    router_name,
    router_selector_labels,
    selector_labels,
)
from iterserve.operator.spec import LLMService

CONTAINER = "router"
# After SIGTERM `iterserve router` gives open requests --drain-timeout seconds (the service's
# drainTimeoutSeconds, as its pods get: a stream through the router lasts as long as the pod serves it).
SHUTDOWN_MARGIN_S = 10


def pods_dns_name(svc: LLMService) -> str:
    """Namespace-qualified without the cluster domain (not always cluster.local): the pod's resolv.conf
    search list completes it."""
    return f"{pods_service_name(svc.name)}.{svc.namespace}.svc"


def router_args(svc: LLMService) -> list[str]:
    return ["--host", "0.0.0.0", "--port", str(HTTP_PORT), "--dns-name", pods_dns_name(svc),
            "--backend-port", str(HTTP_PORT), "--policy", svc.router.policy,
            "--drain-timeout", str(svc.drain_timeout_seconds)]


def build_pods_service(svc: LLMService) -> dict:
    """Headless: its DNS name answers with the addresses of the ready server pods, and only those."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(svc, pods_service_name(svc.name)),
        "spec": {
            "clusterIP": "None",
            "selector": selector_labels(svc.name),
            "publishNotReadyAddresses": False,  # a pod still loading its model must not get requests
            "ports": [{"name": "http", "port": HTTP_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def _container(svc: LLMService) -> dict:
    container = {
        "name": CONTAINER,
        "image": svc.image,  # the server image installs the [router] extra too
        "command": ["iterserve", "router"],
        "args": router_args(svc),
        "env": [{"name": "HOME", "value": "/tmp"}],
        "ports": [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"}],
        # /ready answers 503 while no server pod is routable: the Service then sends nothing here
        "livenessProbe": http_probe("/health", 10, 3),
        "readinessProbe": http_probe("/ready", 2, 2),
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
        **hardened_container(),
    }
    if svc.router.resources:
        container["resources"] = container_resources(svc.router.resources)
    return container


def router_grace_seconds(svc: LLMService) -> int:
    return PRESTOP_SLEEP_S + svc.drain_timeout_seconds + SHUTDOWN_MARGIN_S


def build_router_deployment(svc: LLMService) -> dict:
    """The router pods: no accelerator, so none of the server's nodeSelector, tolerations or resources."""
    pod_spec = hardened_pod_spec(svc, _container(svc), [{"name": "tmp", "emptyDir": {}}], router_grace_seconds(svc))
    return rolling_deployment(
        child_metadata(svc, router_name(svc.name), child_labels=router_labels(svc.name)), svc.router.replicas,
        router_selector_labels(svc.name), router_labels(svc.name), dict(SCRAPE_ANNOTATIONS), pod_spec)
