"""The NetworkPolicy in front of an LLMService's pods (pure).

Only the operator may reach the admin port, where the pods take knob changes; the API port (the
OpenAI API, /metrics, the probes) is open to `spec.networkPolicy.apiFrom` (anywhere when it is not
given) and always to the operator, which reads /metrics for the tuner. Nothing else reaches the pods.
The operator's pods are told apart by their namespace's name and their labels (`OperatorPeer`, from the
operator's flags). A cluster without a NetworkPolicy-enforcing CNI stores the object and ignores it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from iterserve.operator.builders.labels import ADMIN_PORT, HTTP_PORT, child_metadata, selector_labels
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


def build_network_policy(svc: LLMService, operator: OperatorPeer) -> dict | None:
    """None when spec.networkPolicy.enabled is false."""
    if not svc.network_policy.enabled:
        return None
    clients = {"ports": _ports(HTTP_PORT)}
    if svc.network_policy.api_from:
        clients["from"] = [dict(peer) for peer in svc.network_policy.api_from]
    return {
        "apiVersion": API_VERSION,
        "kind": "NetworkPolicy",
        "metadata": child_metadata(svc, svc.name),
        "spec": {
            "podSelector": {"matchLabels": selector_labels(svc.name)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [operator.peer()], "ports": _ports(HTTP_PORT, ADMIN_PORT)},
                clients,  # no `from`: any source
            ],
        },
    }
