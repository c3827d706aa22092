"""The NetworkPolicy in front of an LLMService's pods (pure).

Only the operator may reach the admin port, where the pods take knob changes; the API port (the
OpenAI API, /metrics, the probes) is open to `spec.networkPolicy.apiFrom` (anywhere when it is not
given) and always to the operator, which reads /metrics for the tuner. Nothing else reaches the pods.
With spec.router on, the router's pods reach the API port too, and a second policy, `<name>-router`,
opens the router's port to the same clients (apiFrom keeps reaching the server pods directly: a
Prometheus scraping their /metrics, say).
The operator's pods are told apart by their namespace's name and their labels (`OperatorPeer`, from the
operator's flags). A cluster without a NetworkPolicy-enforcing CNI stores the object and ignores it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from iterserve.operator.builders.labels import (
    ADMIN_PORT,
    HTTP_PORT,
    child_metadata,
    router_labels,
    router_name,
    router_selector_labels,
    selector_labels,
)
from iterserve.operator.constants import DEFAULT_OPERATOR_LABELS, DEFAULT_OPERATOR_NAMESPACE
from iterserve.operator.spec import LLMService

API_VERSION = "networking.k8s.io/v1"
# Set by Kubernetes on every namespace from 1.21 on (and by manifests/ on the operator's own namespace,
# for older clusters).
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"


@dataclass(frozen=True)
class OperatorPeer:
    """Where the operator's pods run and the labels they carry: the only sources for the admin port."""

    namespace: str = DEFAULT_OPERATOR_NAMESPACE
    pod_labels: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_OPERATOR_LABELS))

    def peer(self) -> dict:
        return {"namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: self.namespace}},
                "podSelector": {"matchLabels": dict(self.pod_labels)}}


def parse_labels(text: str) -> dict[str, str]:
    """`k=v,k2=v2` -> {k: v, k2: v2}; ValueError naming what is wrong."""
    labels = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"expected key=value, got {item!r}")
        labels[key] = value
    if not labels:
        raise ValueError("at least one key=value is needed")
    return labels


def _ports(*ports: int) -> list[dict]:
    return [{"protocol": "TCP", "port": port} for port in ports]


def _clients(svc: LLMService, *extra: dict) -> dict:
    """The API port from spec.networkPolicy.apiFrom and `extra` peers; from anywhere without apiFrom."""
    rule = {"ports": _ports(HTTP_PORT)}
    if svc.network_policy.api_from:
        rule["from"] = [dict(peer) for peer in svc.network_policy.api_from] + list(extra)
    return rule


def _policy(metadata: dict, pods: dict[str, str], ingress: list[dict]) -> dict:
    return {"apiVersion": API_VERSION, "kind": "NetworkPolicy", "metadata": metadata,
            "spec": {"podSelector": {"matchLabels": pods}, "policyTypes": ["Ingress"], "ingress": ingress}}


def build_network_policy(svc: LLMService, operator: OperatorPeer) -> dict | None:
    """The server pods' policy; None when spec.networkPolicy.enabled is false."""
    if not svc.network_policy.enabled:
        return None
    # a podSelector alone is a peer in the policy's own namespace: the router's pods
    router = ({"podSelector": {"matchLabels": router_selector_labels(svc.name)}},) if svc.router.enabled else ()
    return _policy(child_metadata(svc, svc.name), selector_labels(svc.name), [
        {"from": [operator.peer()], "ports": _ports(HTTP_PORT, ADMIN_PORT)},
        _clients(svc, *router),  # no `from`: any source
    ])


def build_router_network_policy(svc: LLMService) -> dict | None:
    """The router pods' policy: their port from the clients alone; None without the router or policies."""
    if not (svc.network_policy.enabled and svc.router.enabled):
        return None
    metadata = child_metadata(svc, router_name(svc.name), child_labels=router_labels(svc.name))
    return _policy(metadata, router_selector_labels(svc.name), [_clients(svc)])
