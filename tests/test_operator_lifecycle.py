"""The LLMService's life as tools outside the operator see it, on a real kube-apiserver: observedGeneration
only moves forward (kubectl wait, Argo CD and Flux wait for it), and `kubectl delete` completes at
once in every tuning mode, even while a pass is hung on a pod that never answers."""

from __future__ import annotations

import threading
import time

import kubernetes
import pytest

from iterserve.operator.builders.labels import ADMIN_PORT, HTTP_PORT
from iterserve.operator.constants import GROUP, PLURAL, VERSION
from tests.hung_pod import create_hung_pod
from tests.operator_support import (
    TIMEOUT,
    admin_kube,
    admin_token,
    apply_llmservice,
    assert_no_denials,
    condition,
    merge_patch_llmservice,
    operator,
    operator_rbac,
    start_operator,
    wait_for_status,
)
from tests.waiting import wait_until

__all__ = ["operator", "operator_rbac"]  # fixtures, used by name

POD_TIMEOUT_S = 20  # how long a hung pod holds each call: far beyond the delete bound below
DELETE_BOUND_S = 10  # generous: a delete takes about a second; kopf's fallbacks took 17 and 60 s


class GenerationWatch(threading.Thread):
    """Every (generation, observedGeneration) one LLMService goes through, from a watch on the API."""

    def __init__(self, cluster, namespace: str, name: str):
        super().__init__(daemon=True)
        self.api = kubernetes.client.CustomObjectsApi(cluster.api_client())
        self.namespace, self.name = namespace, name
        self.seen: list[tuple[int, int | None]] = []
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            stream = kubernetes.watch.Watch().stream(
                self.api.list_namespaced_custom_object, GROUP, VERSION, self.namespace, PLURAL,
                field_selector=f"metadata.name={self.name}", timeout_seconds=2)
            for event in stream:
                obj = event["object"]
                self.seen.append((obj["metadata"]["generation"], (obj.get("status") or {}).get("observedGeneration")))

    def stop(self) -> list[tuple[int, int | None]]:
        self.stopped.set()
        self.join(timeout=10)
        return self.seen


def test_observed_generation_never_goes_backwards(kube_cluster, kube_namespace, operator):
    kube, ns = admin_kube(kube_cluster), kube_namespace
    apply_llmservice(kube_cluster, ns, "chat", {"drainTimeoutSeconds": 10})
    wait_for_status(kube, ns, "chat", lambda o: o.get("status", {}).get("observedGeneration") == 1,
                    "generation 1 observed")
    watch = GenerationWatch(kube_cluster, ns, "chat")
    watch.start()
    try:
        for i in range(5):
            # each edit changes the pod template: the Deployment rolls, its status events reach the operator
            merge_patch_llmservice(kube_cluster, ns, "chat", {"spec": {"drainTimeoutSeconds": 11 + i}})
            generation = kube.get_llmservice(ns, "chat")["metadata"]["generation"]
            wait_for_status(kube, ns, "chat",
                            lambda o, g=generation: o.get("status", {}).get("observedGeneration") == g,
                            f"generation {generation} observed")
            time.sleep(1)  # the Deployment's status events that follow the edit
        time.sleep(3)  # and a resync pass
    finally:
        seen = watch.stop()
    observed = [o for _, o in seen if o is not None]
    assert observed and observed[-1] == generation, seen
    backwards = [(a, b) for a, b in zip(observed, observed[1:], strict=False) if b < a]
    assert not backwards, f"observedGeneration went backwards {backwards} in {seen}"
    svc = kube.get_llmservice(ns, "chat")
    assert all(c["observedGeneration"] == generation for c in svc["status"]["conditions"]
               if c["type"] != "Tuned"), svc["status"]["conditions"]


TUNING = {
    "off": {"mode": "off"},
    "observe": {"mode": "observe", "intervalSeconds": 5, "windowSeconds": 10},
    "auto": {"mode": "auto", "intervalSeconds": 5, "windowSeconds": 10},
}


@pytest.mark.parametrize("mode", list(TUNING))
def test_delete_completes_at_once_while_a_pass_is_hung_on_a_pod(kube_cluster, kube_namespace, operator_rbac, mode):
    kube, ns = admin_kube(kube_cluster), kube_namespace
    process = start_operator(kube_cluster, ns, "--standalone", name=f"hung-{mode}",
                             env={"ITERSERVE_OPERATOR_POD_TIMEOUT": str(POD_TIMEOUT_S)})
    silent = None
    try:
        apply_llmservice(kube_cluster, ns, "chat", {"tuning": TUNING[mode], "slo": {"ttftP99Ms": 1000}})
        wait_for_status(kube, ns, "chat", lambda o: o.get("status", {}).get("observedGeneration") == 1
                        and condition(o, "Degraded").get("status") == "False", "reconciled")
        silent = create_hung_pod(kube, ns, "chat", admin_token(kube, ns, "chat"))
        # the resync timer's pass asks the pod for its knobs; the tuner reads its metrics (observe) or
        # its knobs (auto): all of them now wait on a pod that never answers
        expected = {"off": 1, "observe": 1, "auto": 2}[mode]
        wait_until(lambda: silent.paths(ADMIN_PORT).count("/admin/scheduler") >= expected, timeout=TIMEOUT,
                   what="calls hung on the pod's admin port")
        if mode == "observe":
            wait_until(lambda: "/metrics" in silent.paths(HTTP_PORT), timeout=TIMEOUT, what="the tuner's scrape")
        started = time.monotonic()
        kube_cluster.kubectl("delete", "llmservice", "chat", "-n", ns, "--timeout=120s", timeout=130)
        took = time.monotonic() - started
        assert kube.get_llmservice(ns, "chat") is None
        assert took < DELETE_BOUND_S, f"kubectl delete took {took:.1f} s (tuning {mode})"
        assert "/admin/scheduler" not in silent.paths(HTTP_PORT)  # the admin API is called on its own port
    finally:
        if silent is not None:
            silent.close()
        process.stop()
    assert_no_denials(process)
