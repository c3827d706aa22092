"""spec.router's children for a table of specs: valid objects (kubernetes-validate, strict) that put an
`iterserve router` Deployment in front of the pods, a headless Service it finds them through, the Service
`<name>` switched to the router's pods, and NetworkPolicies that let the router in and the clients to it."""

from __future__ import annotations

import pytest

from iterserve.operator.builders.deployment import build_deployment
from iterserve.operator.builders.networkpolicy import OperatorPeer, build_network_policy, build_router_network_policy
from iterserve.operator.builders.pdb import build_pdb
from iterserve.operator.builders.router import build_pods_service, build_router_deployment, router_grace_seconds
from iterserve.operator.builders.service import build_service
from iterserve.operator.reconcile import router_serving
from iterserve.operator.spec import parse_llmservice
from tests.test_operator_builders import KUBE_VERSIONS, UID, flag, service, validate

SERVER_PODS = {"app.kubernetes.io/name": "iterserve", "app.kubernetes.io/instance": "chat"}
ROUTER_PODS = {"app.kubernetes.io/name": "iterserve-router", "app.kubernetes.io/instance": "chat"}
GATEWAY = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}}}
ON = {"enabled": True}

SPECS = {
    "defaults": {"router": ON},
    "prefix-hash, 3 replicas, resources": {
        "router": {"enabled": True, "policy": "prefix-hash", "replicas": 3,
                   "resources": {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "512Mi"}}}},
    "GPU server, private registry, API key": {
        "router": ON, "image": "registry.example.com/iterserve:1.2", "imagePullPolicy": "Always",
        "imagePullSecrets": [{"name": "regcred"}], "apiKeySecretRef": {"name": "chat-key"},
        "resources": {"limits": {"nvidia.com/gpu": 1}}, "nodeSelector": {"gpu": "h100"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]},
    "apiFrom set": {"router": ON, "networkPolicy": {"apiFrom": [GATEWAY]}},
}


def router_children(spec: dict) -> list[dict]:
    svc = service(spec)
    objs = [build_pods_service(svc), build_router_deployment(svc), build_router_network_policy(svc)]
    return [obj for obj in objs if obj is not None]


def router_container(spec: dict) -> dict:
    (c,) = build_router_deployment(service(spec))["spec"]["template"]["spec"]["containers"]
    return c


@pytest.mark.parametrize("case", SPECS)
def test_router_children_are_valid_owned_objects(case):
    objs = router_children(SPECS[case])
    assert [(o["kind"], o["metadata"]["name"]) for o in objs] == [
        ("Service", "chat-pods"), ("Deployment", "chat-router"), ("NetworkPolicy", "chat-router")]
    for obj in objs:
        for version in KUBE_VERSIONS:
            validate(obj, version)
        meta = obj["metadata"]
        assert meta["namespace"] == "team-a"
        assert meta["ownerReferences"] == [{"apiVersion": "iterserve.io/v1alpha1", "kind": "LLMService",
                                            "name": "chat", "uid": UID, "controller": True,
                                            "blockOwnerDeletion": True}]
        assert meta["labels"]["app.kubernetes.io/instance"] == "chat"  # found with the service's other children
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "iterserve-operator"


def test_headless_service_selects_the_ready_server_pods():
    pods = build_pods_service(service(SPECS["defaults"]))
    assert pods["spec"] == {"clusterIP": "None", "selector": SERVER_PODS, "publishNotReadyAddresses": False,
                            "ports": [{"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}]}


@pytest.mark.parametrize("case, policy, replicas", [("defaults", "least-load", 1),
                                                    ("prefix-hash, 3 replicas, resources", "prefix-hash", 3)])
def test_router_runs_iterserve_router_against_the_headless_service(case, policy, replicas):
    deployment = build_router_deployment(service(SPECS[case]))
    c = router_container(SPECS[case])
    assert c["command"] == ["iterserve", "router"]
    assert (flag(c["args"], "--dns-name"), flag(c["args"], "--policy"), flag(c["args"], "--port"),
            flag(c["args"], "--backend-port")) == ("chat-pods.team-a.svc", policy, "8000", "8000")
    assert deployment["spec"]["replicas"] == replicas
    assert c["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}


def test_router_pods_are_hardened_like_the_server_pods():
    spec = SPECS["GPU server, private registry, API key"]
    server = build_deployment(service(spec), "d")["spec"]["template"]["spec"]
    router = build_router_deployment(service(spec))["spec"]["template"]["spec"]
    for key in ("securityContext", "automountServiceAccountToken", "enableServiceLinks", "imagePullSecrets"):
        assert router[key] == server[key], key
    (rc,), (sc,) = router["containers"], server["containers"]
    for key in ("image", "imagePullPolicy", "securityContext", "lifecycle"):
        assert rc[key] == sc[key], key
    assert rc["image"] == "registry.example.com/iterserve:1.2"  # the server image carries the router
    assert {"name": "tmp", "mountPath": "/tmp"} in rc["volumeMounts"] and router["volumes"] == [
        {"name": "tmp", "emptyDir": {}}]
    prestop = int(rc["lifecycle"]["preStop"]["exec"]["command"][1])
    svc = service(spec)
    # the router gives open streams the drain the service's pods give them, inside its grace period
    assert flag(rc["args"], "--drain-timeout") == str(svc.drain_timeout_seconds)
    assert router["terminationGracePeriodSeconds"] == router_grace_seconds(svc) > prestop + svc.drain_timeout_seconds


def test_router_needs_no_accelerator_and_no_key():
    spec = SPECS["GPU server, private registry, API key"]
    router = build_router_deployment(service(spec))["spec"]["template"]["spec"]
    assert "nodeSelector" not in router and "tolerations" not in router
    assert "resources" not in router["containers"][0]
    # the router passes Authorization through; the pods check the key
    assert [e["name"] for e in router["containers"][0]["env"]] == ["HOME"]
    resources = router_container(SPECS["prefix-hash, 3 replicas, resources"])["resources"]
    assert resources == {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "512Mi"}}


def test_router_pods_never_match_a_server_selector():
    svc = service({**SPECS["prefix-hash, 3 replicas, resources"], "replicas": 2})  # 2: with a PDB
    router_pod_labels = build_router_deployment(svc)["spec"]["template"]["metadata"]["labels"]
    server_pod_labels = build_deployment(svc, "d")["spec"]["template"]["metadata"]["labels"]
    server_selectors = [build_deployment(svc, "d")["spec"]["selector"]["matchLabels"],
                        build_pdb(svc)["spec"]["selector"]["matchLabels"],
                        build_pods_service(svc)["spec"]["selector"],
                        build_network_policy(svc, OperatorPeer())["spec"]["podSelector"]["matchLabels"]]
    for selector in server_selectors:
        assert selector.items() <= server_pod_labels.items() and not selector.items() <= router_pod_labels.items()
    router_selector = build_router_deployment(svc)["spec"]["selector"]["matchLabels"]
    assert router_selector == ROUTER_PODS and ROUTER_PODS.items() <= router_pod_labels.items()
    assert not ROUTER_PODS.items() <= server_pod_labels.items()


IN_ROTATION = {**SERVER_PODS, "iterserve.io/rotation": "in"}  # the server pods a plain Service sends to


@pytest.mark.parametrize("spec, to_router, selector", [
    ({}, False, IN_ROTATION),
    ({"router": ON}, False, IN_ROTATION),  # no router pod ready yet: clients stay on the server pods
    ({"router": ON}, True, ROUTER_PODS),
])
def test_service_selects_the_router_once_it_serves(spec, to_router, selector):
    k8s_service = build_service(service(spec), to_router)
    assert k8s_service["metadata"]["name"] == "chat" and k8s_service["spec"]["selector"] == selector
    assert k8s_service["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}]


@pytest.mark.parametrize("status, serving", [(None, False), ({}, False), ({"readyReplicas": 0}, False),
                                             ({"readyReplicas": 1}, True), ({"readyReplicas": 3}, True)])
def test_router_serves_with_one_ready_pod(status, serving):
    deployment = None if status is None else {"status": status}
    assert router_serving(deployment) is serving


OPERATOR = OperatorPeer().peer()
TCP = [{"protocol": "TCP", "port": 8000}]
# (spec, the server pods' client rule, the router pods' ingress or None)
POLICIES = {
    "no router": ({}, {"ports": TCP}, None),
    "router, API from anywhere": ({"router": ON}, {"ports": TCP}, [{"ports": TCP}]),
    "router, apiFrom: the router joins it on the pods": (
        {"router": ON, "networkPolicy": {"apiFrom": [GATEWAY]}},
        {"from": [GATEWAY, {"podSelector": {"matchLabels": ROUTER_PODS}}], "ports": TCP},
        [{"from": [GATEWAY], "ports": TCP}]),
    "router, policies off": ({"router": ON, "networkPolicy": {"enabled": False}}, None, None),
}


@pytest.mark.parametrize("case", POLICIES)
def test_network_policies_let_the_router_in(case):
    spec, clients, router_ingress = POLICIES[case]
    svc = service(spec)
    pods_policy, router_policy = build_network_policy(svc, OperatorPeer()), build_router_network_policy(svc)
    if clients is None:
        assert pods_policy is None
    else:
        assert pods_policy["spec"]["ingress"] == [
            {"from": [OPERATOR], "ports": [{"protocol": "TCP", "port": 8000}, {"protocol": "TCP", "port": 8001}]},
            clients]
    if router_ingress is None:
        assert router_policy is None
        return
    for version in KUBE_VERSIONS:
        validate(router_policy, version)
    assert router_policy["metadata"]["name"] == "chat-router"
    assert router_policy["spec"]["podSelector"] == {"matchLabels": ROUTER_PODS}
    assert router_policy["spec"]["ingress"] == router_ingress  # no admin port: the router has none


def test_router_names_follow_the_service():
    svc = parse_llmservice({"metadata": {"name": "llama-70b", "namespace": "prod", "uid": "u"},
                            "spec": {"router": ON}})
    assert build_router_deployment(svc)["metadata"]["name"] == "llama-70b-router"
    assert build_pods_service(svc)["metadata"]["name"] == "llama-70b-pods"
    assert flag(build_router_deployment(svc)["spec"]["template"]["spec"]["containers"][0]["args"],
                "--dns-name") == "llama-70b-pods.prod.svc"


def test_a_router_deployment_event_reconciles_only_when_it_starts_or_stops_serving():
    import kopf

    from iterserve.operator.handlers import _readiness_changed

    memo = kopf.Memo()

    def event(ready: int, name: str = "chat-router") -> bool:
        return _readiness_changed(memo, {"metadata": {"namespace": "team-a", "name": name},
                                         "status": {"readyReplicas": ready}})

    # first sight, then 0 -> 1 ready, 1 -> 2 (no change), back to 0; another router is tracked apart
    assert [event(0), event(0), event(1), event(2), event(0), event(0, "other-router")] == [
        True, False, True, False, True, True]


@pytest.mark.parametrize("case", ["defaults", "prefix-hash, 3 replicas, resources"])
def test_the_router_parses_the_args_the_operator_gives_it(case):
    """The router's own argument parser takes the operator's args, without Kubernetes."""
    from iterserve.router.cli import build_router
    from iterserve.server.entrypoints.cli import build_parser

    svc = service(SPECS[case])
    args = build_parser().parse_args(["router", *router_container(SPECS[case])["args"]])
    assert (args.dns_name, args.policy, args.port, args.backend_port, args.drain_timeout) == (
        "chat-pods.team-a.svc", svc.router.policy, 8000, 8000, svc.drain_timeout_seconds)
    build_router(args)  # the flags the router checks at start-up pass
