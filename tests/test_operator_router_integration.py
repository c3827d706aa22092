"""spec.router against a real kube-apiserver + controller-manager, the operator as a subprocess with the
manifests' RBAC: turning the router on creates its Deployment, headless Service and NetworkPolicy; the
Service `chat` moves to the router's pods once one is ready (the Endpoints controller then lists them);
turning it off moves the Service back first and removes the router. No scheduler or kubelet: the test
binds pods to a node name and marks them ready through their status subresource, as those would, with
documentation-range IPs (RFC 5737) that nothing here sends traffic to (the operator calls only server
pods with an IP, and the server pod here has none)."""

from __future__ import annotations

import json

from iterserve.operator.kube import path_of
from tests.kubelet_status import PodState, pod_status
from tests.operator_support import (
    TIMEOUT,
    admin_kube,
    apply_llmservice,
    children_of,
    condition,
    events_for,
    merge_patch_llmservice,
    operator,
    operator_rbac,
    wait_for_event,
    wait_for_status,
)
from tests.waiting import wait_until

__all__ = ["operator", "operator_rbac"]  # fixtures, used by name

SERVER_PODS = {"app.kubernetes.io/name": "iterserve", "app.kubernetes.io/instance": "chat"}
ROUTER_PODS = {"app.kubernetes.io/name": "iterserve-router", "app.kubernetes.io/instance": "chat"}
IN_ROTATION = {**SERVER_PODS, "iterserve.io/rotation": "in"}  # the server pods the Service `chat` sends to
GATEWAY = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}}}
WITH_ROUTER = {"Deployment": ["chat", "chat-router"], "Service": ["chat", "chat-pods"],
               "ConfigMap": ["chat-knobs"], "PodDisruptionBudget": [], "NetworkPolicy": ["chat", "chat-router"]}
WITHOUT_ROUTER = {"Deployment": ["chat"], "Service": ["chat"], "ConfigMap": ["chat-knobs"],
                  "PodDisruptionBudget": [], "NetworkPolicy": ["chat"]}


def selector(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in labels.items())


def mark_ready(kube, ns: str, pod: dict, ip: str | None) -> None:
    """What the scheduler (a node, which Endpoints require) and a kubelet (Running, Ready) would write once
    the pod's readiness probe passes."""
    name = pod["metadata"]["name"]
    kube.request("POST", path_of("v1", "Pod", ns, name, "binding"), {
        "apiVersion": "v1", "kind": "Binding", "metadata": {"name": name},
        "target": {"kind": "Node", "name": "node-a"}})
    state = PodState(pod["spec"]["containers"][0]["name"], phase="Running", waiting=None)
    state.host = ip
    state.set_ready(True)
    kube.merge_patch("v1", "Pod", ns, pod["metadata"]["name"], {"status": pod_status(state, pod)}, subresource="status")


def endpoint_ips(cluster, ns: str, name: str) -> list[str]:
    endpoints = json.loads(cluster.kubectl("get", "endpoints", name, "-n", ns, "-o", "json").stdout)
    return sorted(a["ip"] for subset in endpoints.get("subsets") or () for a in subset.get("addresses") or ())


def test_router_on_then_off(kube_cluster, kube_namespace, operator):
    kube, ns = admin_kube(kube_cluster), kube_namespace
    apply_llmservice(kube_cluster, ns, "chat", {"router": {"enabled": True, "policy": "prefix-hash", "replicas": 2},
                                                "apiKeySecretRef": {"name": "chat-key"},
                                                "networkPolicy": {"apiFrom": [GATEWAY]}})
    uid = kube.get_llmservice(ns, "chat")["metadata"]["uid"]
    wait_until(lambda: children_of(kube, ns, "chat") == WITH_ROUTER, timeout=TIMEOUT, what="the router's children")
    for kind, version, name in [("Deployment", "apps/v1", "chat-router"), ("Service", "v1", "chat-pods"),
                                ("NetworkPolicy", "networking.k8s.io/v1", "chat-router")]:
        (ref,) = kube.get(version, kind, ns, name)["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == ("LLMService", "chat", uid, True), kind
    router = kube.get("apps/v1", "Deployment", ns, "chat-router")
    (container,) = router["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["iterserve", "router"] and router["spec"]["replicas"] == 2
    args = container["args"]
    assert (args[args.index("--dns-name") + 1], args[args.index("--policy") + 1]) == (f"chat-pods.{ns}.svc",
                                                                                       "prefix-hash")
    assert container["image"] == kube.get("apps/v1", "Deployment", ns, "chat")["spec"]["template"]["spec"][
        "containers"][0]["image"]
    pods_service = kube.get("v1", "Service", ns, "chat-pods")["spec"]
    assert (pods_service["clusterIP"], pods_service["selector"]) == ("None", SERVER_PODS)
    ingress = kube.get("networking.k8s.io/v1", "NetworkPolicy", ns, "chat")["spec"]["ingress"]
    assert {"podSelector": {"matchLabels": ROUTER_PODS}} in ingress[1]["from"]  # the router reaches the pods
    # no router pod ready yet: clients stay on the server pods
    assert kube.get("v1", "Service", ns, "chat")["spec"]["selector"] == IN_ROTATION

    # the server pod ready (without an IP: nothing to call), the router not yet
    wait_until(lambda: kube.list("v1", "Pod", ns, selector(SERVER_PODS)), timeout=TIMEOUT, what="the server pod")
    (server_pod,) = kube.list("v1", "Pod", ns, selector(SERVER_PODS))
    mark_ready(kube, ns, server_pod, None)
    svc = wait_for_status(kube, ns, "chat", lambda o: condition(o, "Ready").get("reason") == "RouterNotReady",
                          "Ready waits for the router")
    assert condition(svc, "Ready")["message"] == "1/1 replicas ready; router 0/2 ready"
    assert svc["status"]["readyReplicas"] == 1  # the server pods': router pods are not counted

    router_pods = wait_until(lambda: len(kube.list("v1", "Pod", ns, selector(ROUTER_PODS))) == 2
                             and kube.list("v1", "Pod", ns, selector(ROUTER_PODS)), timeout=TIMEOUT,
                             what="the router pods")
    ips = sorted(f"192.0.2.{10 + i}" for i in range(len(router_pods)))
    for pod, ip in zip(router_pods, ips, strict=True):
        mark_ready(kube, ns, pod, ip)
    wait_until(lambda: kube.get("v1", "Service", ns, "chat")["spec"]["selector"] == ROUTER_PODS, timeout=TIMEOUT,
               what="the Service switched to the router")
    wait_until(lambda: endpoint_ips(kube_cluster, ns, "chat") == ips, timeout=TIMEOUT,
               what="the Service's endpoints: the router pods")
    svc = wait_for_status(kube, ns, "chat", lambda o: condition(o, "Ready").get("status") == "True", "Ready")
    assert condition(svc, "Ready")["message"] == "1/1 replicas ready, router 2/2"

    merge_patch_llmservice(kube_cluster, ns, "chat", {"spec": {"router": {"enabled": False}}})
    wait_until(lambda: children_of(kube, ns, "chat") == WITHOUT_ROUTER, timeout=TIMEOUT, what="the router removed")
    assert kube.get("v1", "Service", ns, "chat")["spec"]["selector"] == IN_ROTATION
    ingress = kube.get("networking.k8s.io/v1", "NetworkPolicy", ns, "chat")["spec"]["ingress"]
    assert ingress[1]["from"] == [GATEWAY]
    # garbage collection takes the router's ReplicaSet and pods with its Deployment (the pods, bound to a
    # node, stay Terminating: the kubelet that would confirm their end is not there)
    wait_until(lambda: not kube.list("apps/v1", "ReplicaSet", ns, selector(ROUTER_PODS))
               and all(p["metadata"].get("deletionTimestamp")
                       for p in kube.list("v1", "Pod", ns, selector(ROUTER_PODS))),
               timeout=TIMEOUT, what="the router's pods terminating")
    svc = wait_for_status(kube, ns, "chat", lambda o: condition(o, "Ready").get("status") == "True"
                          and "router" not in condition(o, "Ready").get("message", ""), "Ready without the router")
    wait_for_event(kube, ns, "chat", lambda e: e["reason"] == "Deleted" and "Deployment chat-router deleted" in
                   e["message"], "router Deleted")
    assert not [e for e in events_for(kube, ns, "chat") if e["type"] == "Warning"]
