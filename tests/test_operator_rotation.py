"""Rotation on a real kube-apiserver and kube-controller-manager (no kubelet: the test marks the
ReplicaSet's pods Ready on loopback addresses, where small HTTP servers answer /metrics with the queue
each pod is given). A `TuningLoop` tick in auto mode reads the pods' /metrics itself and labels the pod
whose queue stands out of rotation, which the Service `chat`'s selector then leaves out; a tick after it
drained puts it back. Turned off (tuning observe), every pod is in again, and a reconcile labels in a
pod left out or made before the label."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from iterserve.common.wire import HTTP_PORT, WAITING
from iterserve.operator import controller
from iterserve.operator.builders.labels import ROTATION_LABEL, selector_string
from iterserve.operator.tuning.observe import PodScraper
from iterserve.operator.tuning.operator_metrics import OperatorMetrics
from iterserve.operator.tuning_loop import TuningLoop
from tests.operator_support import TIMEOUT, admin_kube, apply_llmservice, merge_patch_llmservice
from tests.waiting import wait_until

SLO = {"ttftP99Ms": 1000, "itlP99Ms": 100}
AUTO = {"replicas": 3, "slo": SLO, "tuning": {"mode": "auto", "intervalSeconds": 5, "windowSeconds": 10}}
ADDRESSES = [f"127.0.93.{i}" for i in (1, 2, 3)]


class QueuesOnLoopback:
    """One /metrics server per pod address, each answering the requests waiting it is set to."""

    def __init__(self, addresses: list[str]):
        self.waiting = dict.fromkeys(addresses, 0.0)
        queues = self.waiting

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                body = f"# TYPE {WAITING} gauge\n{WAITING}{{model_name=\"m\"}} {queues[self.server.address]}\n"
                self.send_response(200 if self.path == "/metrics" else 404)
                self.send_header("Content-Type", "text/plain")
                self.end_headers()
                self.wfile.write(body.encode())

            def log_message(self, *args):
                pass

        self.servers = []
        for address in addresses:
            server = ThreadingHTTPServer((address, HTTP_PORT), Handler)
            server.address = address  # type: ignore[attr-defined]
            threading.Thread(target=server.serve_forever, daemon=True).start()
            self.servers.append(server)

    def close(self):
        for server in self.servers:
            server.shutdown()
            server.server_close()


@pytest.fixture
def queues():
    q = QueuesOnLoopback(ADDRESSES)
    yield q
    q.close()


def pods(kube, ns) -> list[dict]:
    return sorted(kube.list("v1", "Pod", ns, selector_string("chat")), key=lambda p: p["metadata"]["name"])


def mark_ready(kube, ns, pod: dict, address: str) -> None:
    """What a kubelet reports for a running, ready pod."""
    status = {"phase": "Running", "podIP": address, "podIPs": [{"ip": address}], "hostIP": "127.0.0.1",
              "conditions": [{"type": t, "status": "True"} for t in ("PodScheduled", "Initialized",
                                                                       "ContainersReady", "Ready")]}
    kube.merge_patch("v1", "Pod", ns, pod["metadata"]["name"], {"status": status}, subresource="status")


def endpoint_addresses(kube, ns) -> set[str]:
    """The addresses of the pods the Service `chat`'s selector selects, as the API server evaluates it (the
    Endpoints controller's own input: it refuses these loopback addresses, so its output is not read)."""
    selector = kube.request("GET", f"/api/v1/namespaces/{ns}/services/chat")["spec"]["selector"]
    selected = kube.list("v1", "Pod", ns, ",".join(f"{k}={v}" for k, v in selector.items()))
    return {p["status"]["podIP"] for p in selected if (p.get("status") or {}).get("podIP")}


def labels_by_address(kube, ns) -> dict[str, str | None]:
    return {p["status"]["podIP"]: (p["metadata"].get("labels") or {}).get(ROTATION_LABEL) for p in pods(kube, ns)}


def test_a_pod_whose_queue_stands_leaves_the_service_until_it_drains(kube_cluster, kube_namespace, queues):
    kube, ns = admin_kube(kube_cluster), kube_namespace
    apply_llmservice(kube_cluster, ns, "chat", AUTO)
    assert not controller.handle(kube, kube.get_llmservice(ns, "chat")).problems
    wait_until(lambda: len(pods(kube, ns)) == 3, timeout=TIMEOUT, what="the ReplicaSet's 3 pods")
    for pod, address in zip(pods(kube, ns), ADDRESSES, strict=True):
        mark_ready(kube, ns, pod, address)
    wait_until(lambda: endpoint_addresses(kube, ns) == set(ADDRESSES), timeout=TIMEOUT, what="3 pods selected")
    assert set(labels_by_address(kube, ns).values()) == {"in"}  # the pod template's value

    metrics = OperatorMetrics()
    loop = TuningLoop(kube, ns, "chat", PodScraper(timeout=2.0), metrics)
    queues.waiting.update({ADDRESSES[0]: 130.0, ADDRESSES[1]: 1.0, ADDRESSES[2]: 0.0})  # a step's backlog on one
    loop.run_once(kube.get_llmservice(ns, "chat"))
    assert labels_by_address(kube, ns) == {ADDRESSES[0]: "out", ADDRESSES[1]: "in", ADDRESSES[2]: "in"}
    assert b'iterserve_operator_pods_out_of_rotation{namespace="%s",service="chat"} 1.0' % ns.encode() \
        in metrics.render()
    wait_until(lambda: endpoint_addresses(kube, ns) == set(ADDRESSES[1:]), timeout=TIMEOUT,
               what="the backlogged pod no longer selected")

    queues.waiting.update({ADDRESSES[0]: 5.0})  # draining, still over the shortest by more than the gap (4)
    loop.run_once(kube.get_llmservice(ns, "chat"))
    assert labels_by_address(kube, ns)[ADDRESSES[0]] == "out"
    queues.waiting.update({ADDRESSES[0]: 1.0})  # drained to its peers' level
    loop.run_once(kube.get_llmservice(ns, "chat"))
    assert set(labels_by_address(kube, ns).values()) == {"in"}
    wait_until(lambda: endpoint_addresses(kube, ns) == set(ADDRESSES), timeout=TIMEOUT, what="selected again")

    # observe mode moves nothing on the pods: a standing queue stays in rotation
    queues.waiting.update({ADDRESSES[2]: 60.0})
    merge_patch_llmservice(kube_cluster, ns, "chat", {"spec": {"tuning": {"mode": "observe"}}})
    loop.run_once(kube.get_llmservice(ns, "chat"))
    assert set(labels_by_address(kube, ns).values()) == {"in"}


def test_the_reconcile_labels_in_a_pod_left_out_or_made_before_the_label(kube_cluster, kube_namespace):
    kube, ns = admin_kube(kube_cluster), kube_namespace
    apply_llmservice(kube_cluster, ns, "chat", {**AUTO, "replicas": 2})
    assert not controller.handle(kube, kube.get_llmservice(ns, "chat")).problems
    wait_until(lambda: len(pods(kube, ns)) == 2, timeout=TIMEOUT, what="the ReplicaSet's 2 pods")
    first, second = (p["metadata"]["name"] for p in pods(kube, ns))
    kube.merge_patch("v1", "Pod", ns, first, {"metadata": {"labels": {ROTATION_LABEL: "out"}}})
    kube.merge_patch("v1", "Pod", ns, second, {"metadata": {"labels": {ROTATION_LABEL: None}}})

    def rotation() -> dict[str, str | None]:
        return {p["metadata"]["name"]: (p["metadata"].get("labels") or {}).get(ROTATION_LABEL) for p in pods(kube, ns)}

    outcome = controller.handle(kube, kube.get_llmservice(ns, "chat"))  # auto mode: `out` is rotation's to undo
    assert rotation() == {first: "out", second: "in"}
    assert f"Pod {second} updated: {ROTATION_LABEL}=in" in [str(c) for c in outcome.changes]
    merge_patch_llmservice(kube_cluster, ns, "chat", {"spec": {"tuning": {"mode": "off"}}})
    controller.handle(kube, kube.get_llmservice(ns, "chat"))
    assert rotation() == {first: "in", second: "in"}
