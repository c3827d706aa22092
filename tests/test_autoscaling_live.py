"""spec.autoscaling end to end, live: the operator scales real server pods out when the knobs are spent
and the SLO is still breached, and back in when the load has gone, with no request failed.

A real kube-apiserver + controller-manager, `iterserve operator` with only the manifests' rights, the
kubelet stand-in running each pod as `iterserve serve` of the tiny model on its own 127.0.0.N (its preStop
hook, `sleep 5`, run before the SIGTERM, as a kubelet does), and the Service stand-in sending each request
to the Ready pods in turn. The scenario:
- one pod at max_num_seqs 1, 8 closed-loop clients: 7 requests queue, p99 TTFT is several request times,
  over the SLO (2 request times). The tuner raises max_num_seqs to its bound (2) and says BoundsReached;
  the autoscaler adds the second pod (status.lastScale, a ScaledOut Event with the reason), which starts
  with the tuned knob; at 4 clients the two meet the SLO;
- the load drops to 1 client and a few requests a second: after the scale-down window the autoscaler
  removes a pod (ScaledIn); the pod leaves the endpoints, drains and exits 0; the clients saw no failed
  request through all of it.
"""

from __future__ import annotations

import threading

import httpx
import pytest

from iterserve.operator.builders.labels import IN_ROTATION, ROTATION_LABEL
from iterserve.operator.tuning.pod_admin import get_scheduler
from tests.kubelet_standin import LocalKubelet
from tests.operator_support import (
    LLMSVC,
    TIMEOUT,
    admin_kube,
    admin_token,
    apply_llmservice,
    condition,
    events_for,
    operator,
    operator_rbac,
    wait_for_status,
)
from tests.service_standin import ServiceStandin
from tests.test_tuning_e2e import request_seconds
from tests.waiting import wait_until

__all__ = ["operator", "operator_rbac"]  # fixtures, used by name

pytestmark = [pytest.mark.kube, pytest.mark.timeout(900)]

NAME = "scaled"
SPEC = {"model": {"source": "path", "path": "/models/tiny"}, "replicas": 1, "drainTimeoutSeconds": 10,
        "engine": {"maxNumSeqs": 1, "prefillChunkSize": 256, "maxModelLen": 256, "kvCacheMemory": "8MiB",
                   "threads": 1},
        "autoscaling": {"minReplicas": 1, "maxReplicas": 2, "scaleDownStabilizationSeconds": 10},
        "tuning": {"mode": "auto", "intervalSeconds": 5, "windowSeconds": 10,
                   "bounds": {"maxNumSeqs": {"min": 1, "max": 2}, "prefillChunkSize": {"min": 256, "max": 256}}}}
WAIT = 240.0  # each step waits out a few 10 s windows on a shared box


class Clients:
    """Closed-loop clients, each sending a completion to the Service's next endpoint as soon as its last
    one is answered (and `pause_s` has passed); every outcome kept. `active` of them send (the rest wait);
    both change live."""

    def __init__(self, service: ServiceStandin, total: int, max_tokens: int = 32):
        self.service, self.max_tokens = service, max_tokens
        self.active = total
        self.pause_s = 0.0
        self.outcomes: list[tuple[str, int | None, str]] = []  # (url, status, error)
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(total)]

    def __enter__(self) -> Clients:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stopped.set()
        for t in self._threads:
            t.join(timeout=60)

    def _loop(self, i: int) -> None:
        with httpx.Client(timeout=120, trust_env=False) as http:
            model = http.get(f"{self.service.next_url()}/v1/models").json()["data"][0]["id"]
            body = {"model": model, "prompt": f"the load of client {i}", "max_tokens": self.max_tokens,
                    "ignore_eos": True, "temperature": 0}
            while not self._stopped.is_set():
                if i >= self.active:
                    self._stopped.wait(0.2)
                    continue
                url = self.service.next_url()
                try:
                    r = http.post(f"{url}/v1/completions", json=body)
                    outcome = (url, r.status_code, "" if r.status_code == 200 else r.text[:200])
                except httpx.HTTPError as e:
                    outcome = (url, None, repr(e))
                with self._lock:
                    self.outcomes.append(outcome)
                self._stopped.wait(self.pause_s)

    def failed(self) -> list[tuple[str, int | None, str]]:
        with self._lock:
            return [o for o in self.outcomes if o[1] != 200]


def test_scales_out_when_the_knobs_are_spent_and_in_without_a_failed_request(kube_cluster, kube_namespace,
                                                                              operator, tiny_dir):
    kube, ns = admin_kube(kube_cluster), kube_namespace
    with LocalKubelet(kube_cluster, namespace=ns, model_paths={"/models/tiny": tiny_dir}, prestop=True) as kubelet, \
            ServiceStandin(kube_cluster.api_client(), ns, f"app.kubernetes.io/instance={NAME}",
                           endpoint_labels={ROTATION_LABEL: IN_ROTATION}) as service:
        # the objective: p99 TTFT within 2 request times: at max_num_seqs 2 the 8 clients queue 3 deep on one
        # pod, past it, and 1 deep on each of two
        first = {k: v for k, v in SPEC.items() if k not in ("autoscaling", "tuning")}  # spec.engine's knobs
        apply_llmservice(kube_cluster, ns, NAME, first)
        wait_until(lambda: service.endpoints(), timeout=2 * TIMEOUT, what="the first pod Ready")
        seconds = request_seconds(service.endpoints()[0])
        slo = {"ttftP99Ms": max(20, round(2000 * seconds)), "itlP99Ms": 60_000}
        print(f"one request alone: {seconds * 1000:.0f} ms; SLO {slo}")

        with Clients(service, total=8) as clients:
            apply_llmservice(kube_cluster, ns, NAME, dict(SPEC, slo=slo))
            out = wait_for_status(kube, ns, NAME, lambda o: (o["status"].get("lastScale") or {}).get("to") == 2,
                                  "a scale-out to 2", timeout=WAIT)
            scale = out["status"]["lastScale"]
            assert scale["from"] == 1, scale
            assert out["status"]["knobs"]["maxNumSeqs"] == 2, out["status"]  # the knob went first
            wait_until(lambda: len(service.endpoints()) == 2, timeout=2 * TIMEOUT, what="the second pod Ready")
            token = admin_token(kube, ns, NAME)
            admin = [u.replace(":8000", ":8001") for u in service.endpoints()]
            # the new pod starts with the tuned knob, not spec.engine's
            assert [get_scheduler(u, token)["knobs"]["max_num_seqs"] for u in admin] == [2, 2]
            served = len(clients.outcomes)
            wait_until(lambda: len({o[0] for o in clients.outcomes[served:]}) == 2, timeout=WAIT,
                       what="requests answered by both pods")
            # 4 clients: two pods carry them within the SLO with room (2 a pod, max_num_seqs 2: no queue), what a
            # scale-in later measures one pod fewer against; one pod could not (its batch cap binds)
            clients.active = 4
            wait_for_status(kube, ns, NAME, lambda o: condition(o, "Tuned").get("reason") == "SLOMet"
                            and o["status"].get("readyReplicas") == 2, "the SLO met on two pods", timeout=WAIT)

            # the load drops to a few requests a second: one pod carries it with room
            clients.active, clients.pause_s = 1, 0.2
            wait_for_status(kube, ns, NAME, lambda o: (o["status"].get("lastScale") or {}).get("to") == 1,
                            "a scale-in to 1", timeout=WAIT)
            wait_until(lambda: service.pods() == 1, timeout=2 * TIMEOUT, what="the removed pod gone")
            after = len(clients.outcomes)
            wait_until(lambda: len(clients.outcomes) >= after + 5, timeout=WAIT, what="requests after the scale-in")

        assert clients.failed() == [], clients.failed()[:5]
        assert len({o[0] for o in clients.outcomes}) == 2
        removed = [key for key, codes in kubelet.exit_codes.items() if key[0] == ns]
        assert len(removed) == 1 and kubelet.exit_codes[removed[0]] == [0], kubelet.exit_codes  # drained, exit 0
        log = kubelet.log_path(*removed[0]).read_text(errors="replace")
        assert "SIGTERM: draining" in log, log[-2000:]

    svc = kube.get(LLMSVC, "LLMService", ns, NAME)
    assert svc["status"]["desiredReplicas"] == 1 and condition(svc, "Autoscaling"), svc["status"]
    reasons = [(e["reason"], e["message"]) for e in events_for(kube, ns, NAME)]
    assert any(r == "ScaledOut" and "1 -> 2" in m for r, m in reasons), reasons
    assert any(r == "ScaledIn" and "2 -> 1" in m for r, m in reasons), reasons
