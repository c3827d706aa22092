"""spec.autoscaling in the operator: the replicas in force, other autoscalers found by their target, the
status fields, then against a real kube-apiserver (no kubelet: pods stay Pending):
- `iterserve operator` with only the manifests' rights brings the replicas into spec.autoscaling's range
  and says why in status and Events, refuses with a condition naming an HPA that targets the same
  service, and hands the replicas back to spec.replicas (and the scale subresource) when it is removed;
- one `TuningLoop` tick on a window over the SLO (the pods' metrics given by a source that returns that
  window: there are no pods to read) adds replicas to the Deployment, with the reason in status and the
  Event, and the next tick waits for the new pods;
- without spec.autoscaling, a scale through the subresource (what an HPA writes) is a scale-out to the
  tuner: the next tick's breach takes a smaller chunk where a fleet that did not grow backs max_num_seqs
  off."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from iterserve.operator import controller
from iterserve.operator.autoscaling import conflicting_hpas, replicas_in_force, targets
from iterserve.operator.spec import parse_llmservice
from iterserve.operator.status import ReconcileResult, compute_status
from iterserve.operator.tuning.observation import Observation
from iterserve.operator.tuning_loop import TuningLoop
from tests.operator_support import (
    TIMEOUT,
    admin_kube,
    apply_llmservice,
    children_of,
    condition,
    merge_patch_llmservice,
    operator,
    operator_rbac,
    wait_for_event,
    wait_for_status,
)
from tests.waiting import wait_until

__all__ = ["operator", "operator_rbac"]  # fixtures, used by name
ROOT = Path(__file__).resolve().parents[1]
SLO = {"ttftP99Ms": 1000, "itlP99Ms": 100}


def svc_of(spec: dict, name: str = "chat"):
    return parse_llmservice({"metadata": {"name": name, "namespace": "ns", "uid": "u"}, "spec": spec})


AUTO = {"replicas": 1, "autoscaling": {"minReplicas": 2, "maxReplicas": 5}, "tuning": {"mode": "auto"}, "slo": SLO}


@pytest.mark.parametrize("spec, status, expected", [
    ({"replicas": 3}, {"desiredReplicas": 7}, 3),  # no spec.autoscaling: spec.replicas (an HPA's through /scale)
    (AUTO, {}, 2),  # spec.replicas 1, into the range
    (AUTO, {"desiredReplicas": 4}, 4),  # the autoscaler's count
    (AUTO, {"desiredReplicas": 9}, 5),  # a range narrowed by an edit holds at once
    (AUTO, {"desiredReplicas": True}, 2),  # not a count
])
def test_replicas_in_force(spec, status, expected):
    assert replicas_in_force(svc_of(spec), status) == expected


def hpa(name: str, kind: str, target: str, api: str) -> dict:
    return {"metadata": {"name": name}, "spec": {"scaleTargetRef": {"apiVersion": api, "kind": kind, "name": target}}}


def test_an_hpa_conflicts_when_it_targets_the_service_or_its_deployment():
    svc = svc_of(AUTO)
    hpas = [hpa("b-svc", "LLMService", "chat", "iterserve.io/v1alpha1"), hpa("a-dep", "Deployment", "chat", "apps/v1"),
            hpa("other", "LLMService", "chat2", "iterserve.io/v1alpha1"),
            hpa("foreign", "LLMService", "chat", "example.com/v1"), hpa("sts", "StatefulSet", "chat", "apps/v1")]
    assert conflicting_hpas(hpas, svc) == ("a-dep", "b-svc")


def test_the_shipped_hpa_and_keda_examples_target_the_chat_sample():
    folder = ROOT / "manifests/samples/external-autoscalers"
    (hpa_doc,) = yaml.safe_load_all((folder / "hpa-prometheus-adapter.yaml").read_text())
    kubernetes_validate.validate(hpa_doc, kubernetes_validate.latest_version(), strict=True)
    (keda,) = yaml.safe_load_all((folder / "keda-scaledobject.yaml").read_text())
    chat = yaml.safe_load((ROOT / "manifests/samples/chat.yaml").read_text())
    svc = svc_of(chat["spec"], chat["metadata"]["name"])
    assert svc.autoscaling is None  # they replace spec.autoscaling, never join it
    assert targets(hpa_doc, svc) and targets(keda, svc)  # KEDA's HPA carries the ScaledObject's target
    assert hpa_doc["spec"]["metrics"][0]["pods"]["metric"]["name"] == "vllm_num_requests_waiting"
    assert "vllm:num_requests_waiting" in keda["spec"]["triggers"][0]["metadata"]["query"]


def test_desired_replicas_in_status_belong_to_the_autoscaler_only_with_spec_autoscaling():
    plain = compute_status(ReconcileResult(name="chat", generation=1, replicas_wanted=3), {}, "t")
    assert plain["desiredReplicas"] == 3 and plain["lastScale"] is None
    current = {"conditions": [{"type": "Autoscaling", "status": "True", "reason": "Steady"}], "desiredReplicas": 4}
    scaled = compute_status(ReconcileResult(name="chat", generation=1, replicas_wanted=4, autoscaling=True),
                            current, "t")
    assert "desiredReplicas" not in scaled and "lastScale" not in scaled
    assert [c["type"] for c in scaled["conditions"]].count("Autoscaling") == 1
    dropped = compute_status(ReconcileResult(name="chat", generation=2, replicas_wanted=1), current, "t")
    assert all(c["type"] != "Autoscaling" for c in dropped["conditions"])


# --- against a real API server ------------------------------------------------------------------------

OBSERVE = {"slo": SLO, "tuning": {"mode": "observe", "intervalSeconds": 5, "windowSeconds": 10}}


def deployment_replicas(kube, ns: str, name: str = "chat") -> int | None:
    return (kube.get("apps/v1", "Deployment", ns, name) or {}).get("spec", {}).get("replicas")


def test_operator_keeps_the_range_refuses_beside_an_hpa_and_hands_back(kube_cluster, kube_namespace, operator):
    kube, ns = admin_kube(kube_cluster), kube_namespace
    apply_llmservice(kube_cluster, ns, "chat", {**OBSERVE, "replicas": 1,
                                                "autoscaling": {"minReplicas": 2, "maxReplicas": 4}})
    svc = wait_for_status(kube, ns, "chat", lambda o: condition(o, "Autoscaling").get("reason") == "ScaledOut",
                          "scaled into the range")
    assert svc["status"]["desiredReplicas"] == 2
    assert svc["status"]["lastScale"]["from"] == 1 and svc["status"]["lastScale"]["to"] == 2
    assert "spec.autoscaling.minReplicas is 2" in svc["status"]["lastScale"]["reason"]
    wait_until(lambda: deployment_replicas(kube, ns) == 2 and children_of(kube, ns, "chat")["PodDisruptionBudget"],
               timeout=TIMEOUT, what="2 replicas and a PDB")
    wait_for_event(kube, ns, "chat", lambda e: e["reason"] == "ScaledOut" and "1 -> 2 replicas" in e["message"],
                   "ScaledOut")
    row = kube_cluster.kubectl("get", "llmsvc", "chat", "-n", ns).stdout.split("\n")[1].split()
    assert row[1:3] == ["0", "2"]  # Ready, Desired

    # an HPA on the same service: the operator stands aside and names it
    kube.create({"apiVersion": "autoscaling/v1", "kind": "HorizontalPodAutoscaler",
                 "metadata": {"name": "chat-queue", "namespace": ns},
                 "spec": {"scaleTargetRef": {"apiVersion": "iterserve.io/v1alpha1", "kind": "LLMService",
                                             "name": "chat"}, "minReplicas": 1, "maxReplicas": 3}})
    svc = wait_for_status(kube, ns, "chat", lambda o: condition(o, "Autoscaling").get("reason") == "HPAConflict",
                          "the HPA conflict")
    autoscaling = condition(svc, "Autoscaling")
    assert autoscaling["status"] == "False" and "chat-queue" in autoscaling["message"]
    wait_for_event(kube, ns, "chat", lambda e: e["reason"] == "HPAConflict" and e["type"] == "Warning"
                   and "chat-queue" in e["message"], "HPAConflict")
    kube.delete("autoscaling/v1", "HorizontalPodAutoscaler", ns, "chat-queue")
    wait_for_status(kube, ns, "chat", lambda o: condition(o, "Autoscaling").get("status") != "False", "conflict gone")

    # a narrower range holds at once, with its reason
    merge_patch_llmservice(kube_cluster, ns, "chat", {"spec": {"autoscaling": {"minReplicas": 1, "maxReplicas": 1}}})
    svc = wait_for_status(kube, ns, "chat", lambda o: (o["status"].get("lastScale") or {}).get("to") == 1, "in to 1")
    assert "spec.autoscaling.maxReplicas is 1" in svc["status"]["lastScale"]["reason"]
    wait_until(lambda: deployment_replicas(kube, ns) == 1 and not children_of(kube, ns, "chat")["PodDisruptionBudget"],
               timeout=TIMEOUT, what="1 replica, no PDB")

    # spec.autoscaling removed: spec.replicas (and the scale subresource) rule again
    merge_patch_llmservice(kube_cluster, ns, "chat", {"spec": {"autoscaling": None, "replicas": 3}})
    svc = wait_for_status(kube, ns, "chat", lambda o: o["status"].get("desiredReplicas") == 3
                          and not condition(o, "Autoscaling") and "lastScale" not in o["status"], "handed back")
    wait_until(lambda: deployment_replicas(kube, ns) == 3, timeout=TIMEOUT, what="3 replicas from spec.replicas")


class WindowSource:
    """The pods' metrics as one fixed window (there are no pods here to read): a MetricsSource."""

    def __init__(self, ttft_ms: float, itl_ms: float):  # set them between ticks to change the window
        self.ttft_ms, self.itl_ms = ttft_ms, itl_ms

    def observe(self, pod_urls, now, window_s, since=None):
        return Observation(start=now - window_s, end=now, num_pods=1, num_samples=200, ttft_p99_s=self.ttft_ms / 1000,
                           itl_p99_s=self.itl_ms / 1000, request_rate=4.0, prompt_token_rate=400,
                           generation_token_rate=200, waiting=0.0, running=8.0, queue_time_mean_s=None,
                           kv_usage=0.4, preemption_rate=0.0, error_rate=0.0)

    def snapshot(self, pod_urls, now):
        pass


def test_a_breach_in_the_window_adds_replicas_with_the_reason(kube_cluster, kube_namespace):
    kube, ns = admin_kube(kube_cluster), kube_namespace
    apply_llmservice(kube_cluster, ns, "chat", {**OBSERVE, "replicas": 1,
                                                "autoscaling": {"minReplicas": 1, "maxReplicas": 3}})
    body = kube.get_llmservice(ns, "chat")
    assert not controller.handle(kube, body).problems  # the children, as the operator's reconcile makes them
    assert deployment_replicas(kube, ns) == 1
    loop = TuningLoop(kube, ns, "chat", WindowSource(ttft_ms=3000, itl_ms=50))  # TTFT 3x its SLO: severe
    _, events = loop.run_once(kube.get_llmservice(ns, "chat"))
    svc = kube.get_llmservice(ns, "chat")
    assert condition(svc, "Tuned")["status"] == "False"  # observe mode: the tuner can only recommend
    assert (condition(svc, "Autoscaling")["status"], condition(svc, "Autoscaling")["reason"]) == ("True", "ScaledOut")
    assert svc["status"]["desiredReplicas"] == 2 and deployment_replicas(kube, ns) == 2
    assert "SLO breached with no better knob setting (observe mode)" in svc["status"]["lastScale"]["reason"]
    (scaled,) = [e for e in events if e["reason"] == "ScaledOut"]
    assert "1 -> 2 replicas" in scaled["message"] and "p99 TTFT 3000 ms" in scaled["message"]

    # the new pod cannot start (no kubelet): the next tick waits for it rather than add more
    _, events = loop.run_once(kube.get_llmservice(ns, "chat"))
    svc = kube.get_llmservice(ns, "chat")
    assert deployment_replicas(kube, ns) == 2 and not any(e["reason"] == "ScaledOut" for e in events)
    assert "waiting for the pods added last to start (0/2 ready)" in condition(svc, "Autoscaling")["message"]


def test_a_scale_through_the_subresource_holds_the_tuners_back_off(kube_cluster, kube_namespace):
    kube, ns = admin_kube(kube_cluster), kube_namespace
    spec = {"slo": SLO, "replicas": 1, "engine": {"maxNumSeqs": 16, "prefillChunkSize": 128},
            "tuning": {"mode": "auto", "intervalSeconds": 5, "windowSeconds": 10}}
    knobs = {}
    for name, scaled in (("grown", True), ("same", False)):
        apply_llmservice(kube_cluster, ns, name, spec)
        assert not controller.handle(kube, kube.get_llmservice(ns, name)).problems
        source = WindowSource(ttft_ms=500, itl_ms=50)  # both p99s at half their SLO, nothing waiting: a hold
        loop = TuningLoop(kube, ns, name, source)
        loop.run_once(kube.get_llmservice(ns, name))
        if scaled:  # an HPA's write; no kubelet, so the new pod never starts
            kube_cluster.kubectl("scale", "llmsvc", name, "-n", ns, "--replicas=2")
            assert kube.get_llmservice(ns, name)["spec"]["replicas"] == 2
        # both 3x their SLO, 8 running and none waiting: an overload, whose cure is a back-off
        source.ttft_ms, source.itl_ms = 3000, 300
        _, events = loop.run_once(kube.get_llmservice(ns, name))
        (changed,) = [e for e in events if e["reason"] == "KnobsChanged"]
        knobs[name] = (loop.tuner.state.knobs.max_num_seqs, loop.tuner.state.knobs.prefill_chunk_size,
                       changed["message"])
    seqs, chunk, message = knobs["grown"]
    assert (seqs, chunk) == (16, 64), message
    assert "pods added outside the operator are starting" in message and "not backing max_num_seqs off" in message
    assert knobs["same"][:2] == (4, 128), knobs["same"][2]  # the batch that ran (8), halved
