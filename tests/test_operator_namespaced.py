"""The namespaced mode on a real kube-apiserver with RBAC on: the operator runs as a ServiceAccount (a real
token from the TokenRequest API) that holds nothing but manifests/namespaced/'s Role in one namespace. It
reconciles there, NetworkPolicy included, and can neither act nor read elsewhere."""

from __future__ import annotations

import time

import pytest
import yaml

from iterserve.operator.builders.secret import ADMIN_SECRET
from iterserve.operator.cli import watched_namespaces
from tests.kube_support import write_kubeconfig
from tests.operator_support import (
    TIMEOUT,
    admin_kube,
    admin_token,
    apply_llmservice,
    assert_no_denials,
    children_of,
    condition,
    operator_rbac,
    rendered_manifests,
    start_operator,
    wait_for_status,
)
from tests.waiting import wait_until

__all__ = ["operator_rbac"]  # a fixture, used by name

ONE_OF_EACH = {"Deployment": ["chat"], "Service": ["chat"], "ConfigMap": ["chat-knobs"],
               "PodDisruptionBudget": [], "NetworkPolicy": ["chat"]}
OPERATOR_LABELS = {"app": "ops-test", "tier": "control"}


def service_account_kubeconfig(cluster, namespace: str, name: str):
    """A ServiceAccount of its own with a token from the TokenRequest API, as a kubeconfig."""
    cluster.kubectl("create", "serviceaccount", name, "-n", namespace)
    request = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {"expirationSeconds": 3600}}
    answer = admin_kube(cluster).request("POST", f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token",
                                         request)
    path = cluster.workdir / f"{namespace}-{name}.kubeconfig"
    write_kubeconfig(path, cluster.server, cluster.workdir / "pki/serving.crt", name, answer["status"]["token"])
    return path


def grant_namespaced_role(cluster, namespace: str, account_namespace: str) -> None:
    """manifests/namespaced/'s Role and RoleBinding as they are, for this namespace and that ServiceAccount
    (the manifests' own account holds the cluster-wide binding in this test cluster)."""
    docs = [d for d in rendered_manifests("manifests/namespaced")
            if d["kind"] in ("Role", "RoleBinding") and d["metadata"]["name"] == "iterserve-operator"]
    assert len(docs) == 2
    for doc in docs:
        doc["metadata"]["namespace"] = namespace
        for subject in doc.get("subjects", ()):
            subject["namespace"] = account_namespace
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))


@pytest.mark.parametrize("values, namespaces", [
    (["a"], ["a"]), (["a,b", "c"], ["a", "b", "c"]), (["a, b,", "a"], ["a", "b"]), ([], []),
])
def test_namespace_flag_takes_repeats_and_comma_lists(values, namespaces):
    assert watched_namespaces(values) == namespaces


def test_operator_with_only_the_namespaced_role(kube_cluster, kube_namespace, operator_rbac):
    kube, ns = admin_kube(kube_cluster), kube_namespace
    ops, other = f"{ns}-ops", f"{ns}-other"
    for namespace in (ops, other):
        kube_cluster.kubectl("create", "namespace", namespace)
    kubeconfig = service_account_kubeconfig(kube_cluster, ops, "iterserve-operator")
    grant_namespaced_role(kube_cluster, ns, ops)
    labels = ",".join(f"{k}={v}" for k, v in OPERATOR_LABELS.items())
    process = start_operator(kube_cluster, ns, "--standalone", "--operator-namespace", ops, "--operator-labels",
                             labels, kubeconfig=kubeconfig, name="namespaced")
    try:
        for namespace in (ns, other):
            apply_llmservice(kube_cluster, namespace, "chat", {"apiKeySecretRef": {"name": "chat-key"}})
        wait_until(lambda: children_of(kube, ns, "chat") == ONE_OF_EACH and admin_token(kube, ns, "chat"),
                   timeout=TIMEOUT, what="the children in the operator's namespace")
        svc = wait_for_status(kube, ns, "chat", lambda o: o.get("status", {}).get("observedGeneration") == 1,
                              "status written")
        assert condition(svc, "Degraded")["status"] == "False", svc["status"]

        # the NetworkPolicy: chat's pods; the admin port from the operator's namespace and pods alone
        policy = kube.get("networking.k8s.io/v1", "NetworkPolicy", ns, "chat")
        assert policy["spec"]["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "iterserve",
                                                                 "app.kubernetes.io/instance": "chat"}}
        operator_rule, clients_rule = policy["spec"]["ingress"]
        assert operator_rule["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ops}},
                                          "podSelector": {"matchLabels": OPERATOR_LABELS}}]
        assert {p["port"] for p in operator_rule["ports"]} == {8000, 8001}
        assert "from" not in clients_rule and [p["port"] for p in clients_rule["ports"]] == [8000]
        assert policy["metadata"]["ownerReferences"][0]["name"] == "chat"

        time.sleep(3)  # a resync later: nothing happened in the namespace the operator does not serve
        assert children_of(kube, other, "chat") == {kind: [] for kind in ONE_OF_EACH}
        assert "status" not in kube.get_llmservice(other, "chat")
    finally:
        process.stop()
        for namespace in (ops, other):
            kube_cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
    assert_no_denials(process)  # its Role was enough, CRDs and namespaces untouched

    def can(verb: str, resource: str, *scope: str) -> bool:
        result = kube_cluster.kubectl("auth", "can-i", verb, resource, *scope, kubeconfig=kubeconfig, check=False)
        return result.stdout.strip() == "yes"

    assert all(can(verb, res, "-n", ns) for verb, res in [
        ("patch", "deployments.apps"), ("create", "networkpolicies.networking.k8s.io"), ("create", "secrets"),
        ("get", f"secrets/{ADMIN_SECRET}"), ("patch", f"secrets/{ADMIN_SECRET}"), ("list", "pods"),
        ("watch", "llmservices.iterserve.io"), ("patch", "llmservices.iterserve.io/status")])
    assert not any(can(verb, res, "-n", ns) for verb, res in [
        ("get", "secrets/chat-key"), ("list", "secrets"), ("watch", "secrets"), ("delete", f"secrets/{ADMIN_SECRET}"),
        ("create", "pods"), ("update", "llmservices.iterserve.io")])
    assert not any(can(verb, res, "-n", other) for verb, res in [
        ("patch", "deployments.apps"), ("delete", "deployments.apps"), ("create", "secrets"),
        ("get", f"secrets/{ADMIN_SECRET}"), ("list", "llmservices.iterserve.io"), ("list", "pods"),
        ("create", "events")])
    assert not any(can(verb, res) for verb, res in [
        ("list", "customresourcedefinitions.apiextensions.k8s.io"), ("list", "namespaces"), ("get", "nodes")])
    assert not can("list", "deployments.apps", "--all-namespaces")
