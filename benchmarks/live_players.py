"""What benchmarks/autoscaling_live.py runs beside the operator: the HPA it plays through the LLMService's
scale subresource, the log of the conditions the operator writes, and the router for `router` runs."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import httpx
import kubernetes
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.autoscaling import Hpa
from iterserve.operator.conditions import AUTOSCALING, TUNED
from iterserve.operator.constants import GROUP, PLURAL, VERSION
from tests.dns_standin import HostsDns
from tests.router_support import start_router, wait_healthy
from tests.router_support import stop as stop_process
from tests.service_standin import ServiceStandin

NAMESPACE = "live"
HPA_PERIOD_S = 15.0  # the HPA's sync period


def waiting_per_pod(urls: list[str]) -> float | None:
    """Mean `vllm:num_requests_waiting` over the pods that answered (what the Prometheus adapter serves
    an HPA as an AverageValue pods metric); None when none did."""
    values = []
    for url in urls:
        try:
            text = httpx.get(f"{url}/metrics", timeout=5).text
        except httpx.HTTPError:
            continue
        for family in text_string_to_metric_families(text):
            if family.name == "vllm:num_requests_waiting":
                values.append(sum(s.value for s in family.samples))
    return sum(values) / len(values) if values else None


class HpaPlayer(threading.Thread):
    """An HPA on queue depth, targeting the LLMService's scale subresource."""

    def __init__(self, custom, name: str, service: ServiceStandin, threshold: float, max_replicas: int,
                 scale_down_s: float):
        super().__init__(name=f"hpa-{name}", daemon=True)
        self.custom, self.name, self.service = custom, name, service
        self.hpa = Hpa(threshold, 1, max_replicas, down_window_s=scale_down_s, down_every_s=60.0)
        self.stopped = threading.Event()
        self.changes: list[tuple[float, int]] = []

    def run(self) -> None:
        while not self.stopped.wait(HPA_PERIOD_S):
            urls = self.service.endpoints()
            mean = waiting_per_pod(urls)
            if mean is None:
                continue
            scale = self.custom.get_namespaced_custom_object_scale(GROUP, VERSION, NAMESPACE, PLURAL, self.name)
            current = scale["spec"].get("replicas", 1)
            want = self.hpa.desired(current, SimpleNamespace(queued=mean * len(urls), num_pods=len(urls)),
                                    time.monotonic())
            if want != current:
                self.custom.patch_namespaced_custom_object_scale(
                    GROUP, VERSION, NAMESPACE, PLURAL, self.name, {"spec": {"replicas": want}})
                self.changes.append((time.perf_counter(), want))


class StatusLog(threading.Thread):
    """The service's Tuned and Autoscaling conditions as the operator writes them, and the tuner's last
    decision (`Decision`: its action and reason, which say what a tick held and why), each change with its
    time (read every second): why the replicas and the knobs were what they were, tick by tick."""

    def __init__(self, custom, name: str):
        super().__init__(name=f"conditions-{name}", daemon=True)
        self.custom, self.name = custom, name
        self.stopped = threading.Event()
        self.changes: list[tuple[float, str, str]] = []  # (perf_counter, type, "reason: message")

    def run(self) -> None:
        last: dict[str, str] = {}
        while not self.stopped.wait(1.0):
            try:
                body = self.custom.get_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, self.name)
            except kubernetes.client.ApiException:
                continue
            status = body.get("status") or {}
            seen = [(c.get("type"), f"{c.get('reason')}: {c.get('message')}") for c in status.get("conditions") or []
                    if c.get("type") in (TUNED, AUTOSCALING)]
            if decision := status.get("lastDecision"):
                seen.append(("Decision", f"{decision.get('action')}: {decision.get('reason')}"))
            for kind, text in seen:
                if last.get(kind) != text:
                    last[kind] = text
                    self.changes.append((time.perf_counter(), kind, text))


class Router:
    """`iterserve router` over the service's pods, found as a headless Service's DNS name (the stand-in's),
    with the product's scrape interval and the service's drain timeout."""

    def __init__(self, name: str, service: ServiceStandin):
        self.dns = HostsDns(service, f"{name}-pods.{NAMESPACE}.svc").start()
        try:
            self.proc, self.url = start_router(extra=(
                "--dns-name", self.dns.dns_name, "--backend-port", "8000", "--scrape-interval", "0.2",
                "--drain-timeout", "30"))
            wait_healthy(self.url, *service.endpoints())
        except BaseException:
            self.dns.stop()
            raise

    def stop(self) -> str:
        out = stop_process(self.proc)
        self.dns.stop()
        return out
