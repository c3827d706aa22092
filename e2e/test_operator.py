"""The operator as `kubectl apply -k manifests/` runs it: in the cluster, as its ServiceAccount with only
the manifests' RBAC, two replicas of which one leads, and another taking over when the leader dies."""

from __future__ import annotations

import json

from e2e.support import (
    OPERATOR_NS,
    READY_TIMEOUT,
    SERVER_IMAGE,
    apply_service,
    condition,
    get,
    kubectl,
    pods,
    wait_until,
)

SA = f"system:serviceaccount:{OPERATOR_NS}:iterserve-operator"


def can_i(verb: str, resource: str, ns: str | None = None, subresource: str | None = None) -> bool:
    result = kubectl("auth", "can-i", verb, resource, "--as", SA, *(["-n", ns] if ns else ["--all-namespaces"]),
                     *(["--subresource", subresource] if subresource else []), check=False)
    return result.stdout.strip() == "yes"


def test_operator_runs_in_cluster_as_its_service_account(namespace):
    replicas = pods(OPERATOR_NS, "app.kubernetes.io/name=iterserve-operator")
    assert len(replicas) == 2
    for pod in replicas:
        spec = pod["spec"]
        assert spec["serviceAccountName"] == "iterserve-operator"
        assert spec["securityContext"]["runAsUser"] == 10001
        assert spec["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True
        assert condition(pod, "Ready").get("status") == "True"
        # the ServiceAccount's token is what it authenticates with: mounted by the kubelet
        mounts = [m["mountPath"] for m in spec["containers"][0]["volumeMounts"]]
        assert "/var/run/secrets/kubernetes.io/serviceaccount" in mounts
    leader = get("lease", "iterserve-operator", OPERATOR_NS)["spec"]["holderIdentity"]
    assert leader in {p["metadata"]["name"] for p in replicas}

    # Its rights are the manifests' and no more.
    assert can_i("patch", "llmservices.iterserve.io", namespace, subresource="status")
    assert can_i("create", "deployments.apps", namespace)
    assert can_i("delete", "deployments.apps", namespace)  # spec.router off: its Deployment goes
    assert not can_i("get", "secrets", "kube-system")
    assert not can_i("create", "pods", namespace)
    assert not can_i("delete", "configmaps", namespace)
    assert not can_i("create", "clusterrolebindings.rbac.authorization.k8s.io")

    # And it acts with them from inside the cluster: an LLMService gets its children, owned by it.
    apply_service(namespace, {"image": SERVER_IMAGE, "replicas": 0})
    deployment = wait_until(lambda: get("deployment", "chat", namespace), "the operator to create the Deployment")
    assert deployment["metadata"]["ownerReferences"][0]["kind"] == "LLMService"
    # written by the operator's own client (its server-side apply field manager)
    shown = json.loads(kubectl("get", "deployment", "chat", "-n", namespace, "-o", "json",
                               "--show-managed-fields").stdout)
    managers = {f["manager"] for f in shown["metadata"].get("managedFields") or ()}
    assert "iterserve-operator" in managers, json.dumps(deployment["metadata"])[:500]


def test_operator_leader_failover(namespace):
    leader = get("lease", "iterserve-operator", OPERATOR_NS)["spec"]["holderIdentity"]
    assert get("pod", leader, OPERATOR_NS), f"the Lease holder {leader} is not a pod of the operator Deployment"
    kubectl("delete", "pod", leader, "-n", OPERATOR_NS, "--grace-period=0", "--force")
    new_leader = wait_until(
        lambda: (h := (get("lease", "iterserve-operator", OPERATOR_NS) or {}).get("spec", {}).get("holderIdentity"))
        not in (None, leader) and h, "another operator replica to lead", timeout=READY_TIMEOUT)
    assert get("pod", new_leader, OPERATOR_NS), new_leader
    # the new leader reconciles
    apply_service(namespace, {"image": SERVER_IMAGE, "replicas": 0})
    wait_until(lambda: get("deployment", "chat", namespace), "the new leader to reconcile")
    # and the Deployment replaces the deleted replica
    wait_until(lambda: len([p for p in pods(OPERATOR_NS, "app.kubernetes.io/name=iterserve-operator")
                            if condition(p, "Ready").get("status") == "True"
                            and not p["metadata"].get("deletionTimestamp")]) == 2,
               "two Ready operator replicas again", timeout=READY_TIMEOUT)
