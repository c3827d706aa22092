"""The Kubernetes test harness is a real control plane: storage, RBAC, CRDs, controllers and GC."""

from __future__ import annotations

import json
import time

import kubernetes
import pytest
import yaml

from tests.kube_support import crd_documents, install_crds
from tests.waiting import wait_until

OPERATOR_ROLE = """
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {name: iterserve-operator, namespace: NS}
rules:
- apiGroups: [""]
  resources: [configmaps]
  verbs: [get, list, watch, create, update, patch, delete]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {name: iterserve-operator, namespace: NS}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: Role, name: iterserve-operator}
subjects:
- {kind: ServiceAccount, name: iterserve-operator, namespace: iterserve-system}
"""

WIDGET_CRD = """
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata: {name: widgets.harness.iterserve.io}
spec:
  group: harness.iterserve.io
  scope: Namespaced
  names: {plural: widgets, singular: widget, kind: Widget, shortNames: [wdg]}
  versions:
  - name: v1
    served: true
    storage: true
    subresources:
      status: {}
      scale: {specReplicasPath: .spec.replicas, statusReplicasPath: .status.replicas}
    additionalPrinterColumns:
    - {name: Replicas, type: integer, jsonPath: .spec.replicas}
    schema:
      openAPIV3Schema:
        type: object
        properties:
          spec:
            type: object
            properties: {replicas: {type: integer, minimum: 0, default: 1}}
          status:
            type: object
            properties: {replicas: {type: integer}}
"""


@pytest.fixture
def namespace(kube_namespace):
    return kube_namespace


def configmap(name: str, namespace: str, owner: dict | None = None) -> dict:
    metadata = {"name": name, "namespace": namespace}
    if owner is not None:
        metadata["ownerReferences"] = [{"apiVersion": "v1", "kind": "ConfigMap", "name": owner["metadata"]["name"],
                                        "uid": owner["metadata"]["uid"]}]
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": {"k": "v"}}


def test_namespaced_crud_as_admin(kube_cluster, namespace):
    with kube_cluster.api_client() as client:
        core = kubernetes.client.CoreV1Api(client)
        core.create_namespaced_config_map(namespace, configmap("settings", namespace))
        core.patch_namespaced_config_map("settings", namespace, {"data": {"k": "changed"}})
        assert core.read_namespaced_config_map("settings", namespace).data == {"k": "changed"}
        core.delete_namespaced_config_map("settings", namespace)
        with pytest.raises(kubernetes.client.ApiException) as missing:
            core.read_namespaced_config_map("settings", namespace)
    assert missing.value.status == 404
    assert kube_cluster.server.startswith("https://127.0.0.1:")


def test_operator_is_forbidden_until_rbac_grants_it(kube_cluster, namespace):
    as_operator = dict(kubeconfig=kube_cluster.operator_kubeconfig, check=False)
    denied = kube_cluster.kubectl("get", "configmaps", "-n", namespace, **as_operator)
    assert denied.returncode != 0 and "forbidden" in denied.stderr.lower()
    assert "system:serviceaccount:iterserve-system:iterserve-operator" in denied.stderr

    kube_cluster.kubectl("apply", "-f", "-", input=OPERATOR_ROLE.replace("NS", namespace))
    # The authorizer reads RBAC objects from an informer: allow it a moment to see the new binding.
    wait_until(lambda: kube_cluster.kubectl("get", "configmaps", "-n", namespace, **as_operator).returncode == 0,
               timeout=30, what="the RoleBinding to take effect")
    kube_cluster.kubectl("create", "configmap", "made-by-operator", "-n", namespace,
                         kubeconfig=kube_cluster.operator_kubeconfig)
    still_denied = kube_cluster.kubectl("get", "secrets", "-n", namespace, **as_operator)
    assert still_denied.returncode != 0 and "forbidden" in still_denied.stderr.lower()


def test_deployment_gets_replicaset_and_pods(kube_cluster, namespace):
    kube_cluster.kubectl("create", "deployment", "web", "--image=example.invalid/web:1", "--replicas=2",
                         "-n", namespace)
    pods = wait_until(lambda: _items(kube_cluster, "pods", namespace, "app=web", expected=2),
                      timeout=60, what="2 pods from the Deployment's ReplicaSet")
    replicasets = _items(kube_cluster, "replicasets", namespace, "app=web", expected=1)
    assert replicasets[0]["metadata"]["ownerReferences"][0]["kind"] == "Deployment"
    assert {pod["metadata"]["ownerReferences"][0]["name"] for pod in pods} == {replicasets[0]["metadata"]["name"]}
    assert all(pod["status"]["phase"] == "Pending" for pod in pods)  # no scheduler, no kubelet

    kube_cluster.kubectl("scale", "deployment/web", "--replicas=1", "-n", namespace)
    wait_until(lambda: _items(kube_cluster, "pods", namespace, "app=web", expected=1), timeout=60,
               what="the scaled-down Deployment to delete a pod")


def test_deleting_an_owner_garbage_collects_what_it_owns(kube_cluster, namespace):
    with kube_cluster.api_client() as client:
        core = kubernetes.client.CoreV1Api(client)
        owner = client.sanitize_for_serialization(
            core.create_namespaced_config_map(namespace, configmap("owner", namespace)))
        core.create_namespaced_config_map(namespace, configmap("owned", namespace, owner=owner))
        core.create_namespaced_config_map(namespace, configmap("bystander", namespace))
        core.delete_namespaced_config_map("owner", namespace)
        wait_until(lambda: not _exists(core.read_namespaced_config_map, "owned", namespace), timeout=90,
                   what="the garbage collector to delete the owned ConfigMap")
        assert _exists(core.read_namespaced_config_map, "bystander", namespace)


def test_crds_install_with_printer_columns_and_scale(kube_cluster, namespace, tmp_path):
    (tmp_path / "widgets.yaml").write_text(WIDGET_CRD)
    (tmp_path / "notes.yaml").write_text("kind: ConfigMap\napiVersion: v1\nmetadata: {name: not-a-crd}\n")
    assert [doc["metadata"]["name"] for doc in crd_documents([tmp_path, tmp_path / "absent"])] == \
        ["widgets.harness.iterserve.io"]
    install_crds(kube_cluster, [tmp_path])

    kube_cluster.kubectl("apply", "-n", namespace, "-f", "-",
                         input=yaml.safe_dump({"apiVersion": "harness.iterserve.io/v1", "kind": "Widget",
                                               "metadata": {"name": "w"}, "spec": {}}))
    table = kube_cluster.kubectl("get", "wdg", "w", "-n", namespace).stdout.split()
    assert table == ["NAME", "REPLICAS", "w", "1"]  # default from the schema, column from the CRD
    kube_cluster.kubectl("scale", "widget/w", "--replicas=3", "-n", namespace)
    widget = json.loads(kube_cluster.kubectl("get", "widget", "w", "-n", namespace, "-o", "json").stdout)
    assert widget["spec"]["replicas"] == 3


def test_kustomize_apply(kube_cluster, namespace, tmp_path):
    (tmp_path / "kustomization.yaml").write_text(
        f"namespace: {namespace}\nresources: [cm.yaml]\nlabels:\n- pairs: {{team: a}}\n")
    (tmp_path / "cm.yaml").write_text(yaml.safe_dump(configmap("from-kustomize", "ignored")))
    kube_cluster.kubectl("apply", "-k", str(tmp_path))
    made = json.loads(kube_cluster.kubectl("get", "configmap", "from-kustomize", "-n", namespace,
                                           "-o", "json").stdout)
    assert made["metadata"]["labels"] == {"team": "a"}


def _items(cluster, kind: str, namespace: str, selector: str, expected: int) -> list[dict] | None:
    listing = json.loads(cluster.kubectl("get", kind, "-n", namespace, "-l", selector, "-o", "json").stdout)
    live = [item for item in listing["items"] if not item["metadata"].get("deletionTimestamp")]
    return live if len(live) == expected else None


def _exists(read, name: str, namespace: str) -> bool:
    try:
        read(name, namespace)
        return True
    except kubernetes.client.ApiException as e:
        if e.status == 404:
            return False
        raise


def test_wait_until_reports_what_it_waited_for():
    calls = iter([None, 0, "done"])
    assert wait_until(lambda: next(calls), timeout=5, interval=0) == "done"
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="the impossible"):
        wait_until(lambda: False, timeout=0.2, interval=0.05, what="the impossible")
    assert time.monotonic() - started < 5
