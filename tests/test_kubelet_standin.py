"""The kubelet stand-in runs a Deployment's pod as a real `iterserve serve` on the pod's own loopback IP:
env from a ConfigMap and a Secret, Ready from /ready, restart after a crash, stop when the pod is deleted."""

from __future__ import annotations

import os
import signal

import httpx
import kubernetes
import yaml

from tests.kubelet_standin import LocalKubelet
from tests.server_support import add_tiny_tokenizer
from tests.waiting import wait_until

ADMIN_TOKEN = "admin-token-for-test"


def manifests(namespace: str) -> str:
    labels = {"app": "tiny"}
    container = {
        "name": "server", "image": "ghcr.io/iterserve/server:test",
        "command": ["iterserve", "serve"],
        "args": ["--host", "0.0.0.0", "--port", "8000", "--model", "/models/tiny", "--kv-cache-memory", "8MiB",
                 "--max-num-seqs", "$(ITERSERVE_MAX_NUM_SEQS)"],
        "env": [
            {"name": "ITERSERVE_MAX_NUM_SEQS",
             "valueFrom": {"configMapKeyRef": {"name": "tiny-knobs", "key": "max-num-seqs"}}},
            {"name": "ITERSERVE_ADMIN_TOKEN", "valueFrom": {"secretKeyRef": {"name": "tiny-admin", "key": "token"}}},
            {"name": "HOME", "value": "/tmp"},  # as the product's Deployment sets it
        ],
        "ports": [{"name": "http", "containerPort": 8000}],
        "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}},
    }
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "tiny", "namespace": namespace},
        "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                 "template": {"metadata": {"labels": labels},
                              "spec": {"containers": [container], "terminationGracePeriodSeconds": 20}}},
    }
    configmap = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "tiny-knobs", "namespace": namespace},
                 "data": {"max-num-seqs": "3"}}
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "tiny-admin", "namespace": namespace},
              "stringData": {"token": ADMIN_TOKEN}}
    return yaml.safe_dump_all([configmap, secret, deployment])


def ready_pod(core, namespace: str, min_restarts: int = 0):
    for pod in core.list_namespaced_pod(namespace, label_selector="app=tiny").items:
        conditions = {c.type: c.status for c in pod.status.conditions or []}
        statuses = pod.status.container_statuses or []
        if conditions.get("Ready") == "True" and statuses and statuses[0].restart_count >= min_restarts:
            return pod
    return None


def test_deployment_pod_runs_as_a_local_server(kube_cluster, kube_namespace, tiny_llama, tmp_path):
    model_dir = add_tiny_tokenizer(tiny_llama[0], tmp_path / "tiny")
    kube_cluster.kubectl("apply", "-f", "-", input=manifests(kube_namespace))
    kubelet = LocalKubelet(kube_cluster, namespace=kube_namespace,
                           extra_args=["--threads", "1", "--log-level", "warning"],
                           model_paths={"/models/tiny": model_dir})
    with kubelet, kube_cluster.api_client() as client:
        core, apps = kubernetes.client.CoreV1Api(client), kubernetes.client.AppsV1Api(client)
        pod = wait_until(lambda: ready_pod(core, kube_namespace), timeout=120, what="the pod to become Ready")
        name, pod_ip = pod.metadata.name, pod.status.pod_ip
        assert pod.spec.node_name == "local-0" and pod.status.phase == "Running"
        assert {c.type: c.status for c in core.read_node("local-0").status.conditions}["Ready"] == "True"
        assert pod_ip.startswith("127.") and pod_ip != "127.0.0.1"

        # The server on the pod's IP got its knob from the ConfigMap and its admin token from the Secret.
        scheduler = httpx.get(f"http://{pod_ip}:8000/admin/scheduler", trust_env=False,
                              headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}).json()
        assert scheduler["knobs"]["max_num_seqs"] == 3
        wait_until(lambda: apps.read_namespaced_deployment_status("tiny", kube_namespace).status.ready_replicas == 1,
                   timeout=60, what="the Deployment to count the pod ready")

        # A crashed server is restarted on the same IP and counted.
        first_pid = int(pod.status.container_statuses[0].container_id.removeprefix("local://"))
        # The pod's HOME is its own; the cache of built kernels is the image's, which the host's stands in for.
        with open(f"/proc/{first_pid}/environ") as f:
            environ = dict(e.split("=", 1) for e in f.read().split("\0") if e)
        assert environ["HOME"] == "/tmp"
        assert environ["XDG_CACHE_HOME"] == os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))
        os.kill(first_pid, signal.SIGKILL)
        pod = wait_until(lambda: ready_pod(core, kube_namespace, min_restarts=1), timeout=120,
                         what="the crashed server to be restarted and Ready")
        assert (pod.metadata.name, pod.status.pod_ip) == (name, pod_ip)
        assert kubelet.restarts(kube_namespace, name) == 1 and kubelet.pod_host(kube_namespace, name) == pod_ip
        assert pod.status.container_statuses[0].last_state.terminated.exit_code == 128 + signal.SIGKILL
        second_pid = int(pod.status.container_statuses[0].container_id.removeprefix("local://"))

        # Scaling to zero deletes the pod: the kubelet SIGTERMs the server, then removes the object.
        kube_cluster.kubectl("scale", "deployment/tiny", "--replicas=0", "-n", kube_namespace)
        wait_until(lambda: not core.list_namespaced_pod(kube_namespace, label_selector="app=tiny").items,
                   timeout=60, what="the deleted pod to be removed")
        assert not os.path.exists(f"/proc/{second_pid}")
        assert kubelet.exit_codes[(kube_namespace, name)] == [128 + signal.SIGKILL, 0]  # 0: drained on SIGTERM


def test_prestop_exec_hook_runs_before_the_kill_within_the_grace_period(tmp_path):
    from tests.kubelet_standin import run_prestop

    marker = tmp_path / "hook-ran"
    hook = {"lifecycle": {"preStop": {"exec": {"command": ["sh", "-c", f"sleep 0.3; touch {marker}"]}}}}
    took = run_prestop(hook, grace=10)
    assert marker.exists() and 0.3 <= took < 5
    # a hook longer than the grace period is cut off there, as a kubelet cuts it
    took = run_prestop({"lifecycle": {"preStop": {"exec": {"command": ["sleep", "30"]}}}}, grace=0.5)
    assert 0.5 <= took < 5
    # nothing to run: no hook, an httpGet hook
    assert run_prestop({}, grace=10) == 0.0
    assert run_prestop({"lifecycle": {"preStop": {"httpGet": {"path": "/", "port": 80}}}}, grace=10) == 0.0


def test_readiness_follows_the_probes_period_timeout_and_failure_threshold():
    """A Ready pod leaves its Service only after failureThreshold probes failed, periodSeconds apart, each
    not answered 200 within timeoutSeconds: a slow answer within the timeout keeps it Ready."""
    import http.server
    import threading
    import time
    import types

    from tests.kubelet_standin import _PodRunner

    answer = {"delay": 0.0, "status": 200}

    class Ready(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            time.sleep(answer["delay"])
            self.send_response(answer["status"])
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Ready)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    pod = {"metadata": {"name": "p", "namespace": "ns", "uid": "u"},
           "spec": {"containers": [{"name": "server", "ports": [{"name": "http", "containerPort": 8000}],
                                    "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"},
                                                       "periodSeconds": 2, "timeoutSeconds": 2,
                                                       "failureThreshold": 2}}]}}
    runner = _PodRunner(types.SimpleNamespace(pod_states={}), pod)
    runner.host, runner.port, runner.process = "127.0.0.1", server.server_address[1], object()
    try:
        with httpx.Client(trust_env=False, timeout=1.0) as http_client:  # as the pod's thread makes it
            def probe() -> bool:
                runner.state.set_ready(runner._probe(http_client))
                return runner.state.ready

            assert probe()
            answer["delay"] = 1.3  # slower than the client's own timeout, within the probe's
            deadline = time.monotonic() + 2.5
            while time.monotonic() < deadline:
                assert probe()
                time.sleep(0.2)
            answer["delay"], answer["status"] = 0.0, 503
            assert probe()  # between two periods the last answer holds
            time.sleep(2.05)
            assert probe()  # one failure of two
            time.sleep(2.05)
            assert not probe()
            answer["status"] = 200
            assert probe()  # a pod not Ready is probed every round
    finally:
        server.shutdown()
