"""The NetworkPolicy in front of an LLMService's pods, for a table of specs and operator identities: a
valid object (kubernetes-validate, strict) that opens the admin port to the operator's pods alone and
the API port to spec.networkPolicy.apiFrom (anywhere by default); its spec errors; where the operator
finds a pod's admin API."""

from __future__ import annotations

import pytest

from iterserve.operator.builders.networkpolicy import OperatorPeer, build_network_policy, parse_labels
from iterserve.operator.reconcile import pod_admin_url
from iterserve.operator.spec import SpecError
from tests.test_operator_builders import KUBE_VERSIONS, UID, service, validate

SELECT_CHAT = {"app.kubernetes.io/name": "iterserve", "app.kubernetes.io/instance": "chat"}
DEFAULT_OPERATOR = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "iterserve-system"}},
                    "podSelector": {"matchLabels": {"app.kubernetes.io/name": "iterserve-operator"}}}
TCP = lambda *ports: [{"protocol": "TCP", "port": p} for p in ports]  # noqa: E731
GATEWAY = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}}}
MONITORING = {"namespaceSelector": {"matchLabels": {"team": "monitoring"}},
              "podSelector": {"matchExpressions": [{"key": "app", "operator": "In", "values": ["prometheus"]}]}}
OFFICE = {"ipBlock": {"cidr": "10.20.0.0/16", "except": ["10.20.9.0/24"]}}

# (spec.networkPolicy, operator identity, expected ingress rules); every case selects chat's pods only
CASES = {
    "default: API from anywhere": (
        {}, OperatorPeer(),
        [{"from": [DEFAULT_OPERATOR], "ports": TCP(8000, 8001)}, {"ports": TCP(8000)}]),
    "empty apiFrom is anywhere": (
        {"apiFrom": []}, OperatorPeer(),
        [{"from": [DEFAULT_OPERATOR], "ports": TCP(8000, 8001)}, {"ports": TCP(8000)}]),
    "API from chosen peers": (
        {"apiFrom": [GATEWAY, MONITORING, OFFICE]}, OperatorPeer(),
        [{"from": [DEFAULT_OPERATOR], "ports": TCP(8000, 8001)}, {"from": [GATEWAY, MONITORING, OFFICE],
                                                                  "ports": TCP(8000)}]),
    "operator elsewhere, other labels": (
        {}, OperatorPeer("ops", {"app": "llm-operator", "tier": "control"}),
        [{"from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ops"}},
                    "podSelector": {"matchLabels": {"app": "llm-operator", "tier": "control"}}}],
          "ports": TCP(8000, 8001)},
         {"ports": TCP(8000)}]),
}


@pytest.mark.parametrize("case", CASES)
def test_network_policy(case):
    network_policy, operator, ingress = CASES[case]
    policy = build_network_policy(service({"networkPolicy": network_policy}), operator)
    for version in KUBE_VERSIONS:
        validate(policy, version)
    assert policy["metadata"]["name"] == "chat" and policy["metadata"]["namespace"] == "team-a"
    assert policy["metadata"]["ownerReferences"][0]["uid"] == UID
    assert policy["spec"]["podSelector"] == {"matchLabels": SELECT_CHAT}
    assert policy["spec"]["policyTypes"] == ["Ingress"]  # what leaves the pods is not restricted
    assert policy["spec"]["ingress"] == ingress


def test_admin_port_is_only_in_the_operators_rule():
    for network_policy, operator, _ in CASES.values():
        rules = build_network_policy(service({"networkPolicy": network_policy}), operator)["spec"]["ingress"]
        admin_rules = [rule for rule in rules if {"protocol": "TCP", "port": 8001} in rule["ports"]]
        assert admin_rules == [{"from": [operator.peer()], "ports": TCP(8000, 8001)}]


def test_disabled_means_no_policy():
    assert build_network_policy(service({"networkPolicy": {"enabled": False}}), OperatorPeer()) is None


@pytest.mark.parametrize("network_policy, field", [
    ({"apiFrom": [{}]}, "spec.networkPolicy.apiFrom[0]: must set podSelector, namespaceSelector or ipBlock"),
    ({"apiFrom": [GATEWAY, {**OFFICE, **GATEWAY}]},
     "spec.networkPolicy.apiFrom[1].ipBlock: may not be combined with podSelector or namespaceSelector"),
    ({"enabled": "yes"}, "spec.networkPolicy.enabled: must be true or false"),
    ({"apiFrom": "everyone"}, "spec.networkPolicy.apiFrom: must be a list of objects"),
])
def test_bad_network_policy_specs_name_the_field(network_policy, field):
    with pytest.raises(SpecError) as error:
        service({"networkPolicy": network_policy})
    assert field in str(error.value)


@pytest.mark.parametrize("text, labels", [
    ("app.kubernetes.io/name=iterserve-operator", {"app.kubernetes.io/name": "iterserve-operator"}),
    (" app=op , tier=control ", {"app": "op", "tier": "control"}),
    ("app=", {"app": ""}),
])
def test_parse_labels(text, labels):
    assert parse_labels(text) == labels


@pytest.mark.parametrize("text", ["", "app", "=x", ","])
def test_parse_labels_refuses(text):
    with pytest.raises(ValueError):
        parse_labels(text)


@pytest.mark.parametrize("ports, url", [
    ([{"name": "http", "containerPort": 8000}, {"name": "admin", "containerPort": 8001}], "http://10.1.2.3:8001"),
    ([{"name": "http", "containerPort": 8000}], "http://10.1.2.3:8000"),  # a pod from before the admin port
    ([{"name": "admin", "containerPort": 9443}], "http://10.1.2.3:9443"),
])
def test_admin_url_is_the_pods_admin_port(ports, url):
    pod = {"spec": {"containers": [{"name": "server", "ports": ports}]}, "status": {"podIP": "10.1.2.3"}}
    assert pod_admin_url(pod) == url
