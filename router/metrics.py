"""The router's own Prometheus metrics, on its /metrics: what it routed where, and what it cost.

Added latency is measured at the two places a proxy adds it: from the request's arrival to its last
byte written to the pod (`to_upstream`: reading the body, routing, connecting), and from the pod's
response head to the head written to the client (`to_client`). Time to first byte, pod wait included,
is there too for comparison with the pods' own TTFT. Pod gauges are read from the pod set at scrape
time, so the request path updates none of them.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

# 50 us .. 10 s: the router's own overhead sits in the lowest buckets, first bytes in the upper ones
LATENCY_BUCKETS = (5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)


class _PodCollector:
    def __init__(self, pods) -> None:
        self.pods = pods

    def collect(self):
        in_flight = GaugeMetricFamily("iterserve:router_pod_in_flight",
                                      "Requests this router has sent to the pod and not finished.", labels=["pod"])
        healthy = GaugeMetricFamily("iterserve:router_pod_healthy",
                                    "1 while the pod is routable (its last scrape succeeded), else 0.",
                                    labels=["pod"])
        waiting = GaugeMetricFamily("iterserve:router_pod_waiting",
                                    "vllm:num_requests_waiting at the pod's last scrape.", labels=["pod"])
        requests = GaugeMetricFamily("iterserve:router_pod_requests",
                                     "Requests on the pod as least-load counts them: this router's in flight, "
                                     "or waiting + running at the last scrape (less this router's ended since) "
                                     "if more.", labels=["pod"])
        kv = GaugeMetricFamily("iterserve:router_pod_kv_cache_usage_perc",
                               "vllm:kv_cache_usage_perc at the pod's last scrape.", labels=["pod"])
        prefill = GaugeMetricFamily("iterserve:router_pod_prefill_ahead_tokens",
                                    "Prompt tokens a new prompt would wait behind on the pod (least-load's "
                                    "estimate: its pending tokens at the last scrape and this router's since).",
                                    labels=["pod"])
        for pod in list(self.pods.pods.values()):
            in_flight.add_metric([pod.url], pod.load.in_flight)
            healthy.add_metric([pod.url], 1 if pod.healthy else 0)
            waiting.add_metric([pod.url], pod.load.waiting)
            requests.add_metric([pod.url], pod.load.requests())
            kv.add_metric([pod.url], pod.load.kv_usage)
            prefill.add_metric([pod.url], pod.load.prefill_ahead())
        yield from (in_flight, healthy, waiting, requests, kv, prefill)


class RouterMetrics:
    def __init__(self, pods) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("iterserve:router_requests", "Requests proxied, by pod and HTTP status "
                                "(pod \"none\": no pod could take it).", ["pod", "code"], registry=self.registry)
        self.decisions = Counter("iterserve:router_decisions", "Routing decisions, by policy and outcome: "
                                 "primary (the policy's first choice), spilled (prefix-hash: the key's pod was over "
                                 "the load bound), retry (after a pod failed to connect or was draining).",
                                 ["policy", "outcome"], registry=self.registry)
        self.upstream_failures = Counter("iterserve:router_upstream_failures", "Pod connections that failed "
                                         "before any response byte, by reason.", ["pod", "reason"],
                                         registry=self.registry)
        self.connections = Counter("iterserve:router_upstream_connections", "Connections opened to each pod "
                                   "(a request that finds an idle one in the pool opens none).", ["pod"],
                                   registry=self.registry)
        self.added = Histogram("iterserve:router_added_latency_seconds", "Latency the router adds, by stage: "
                               "to_upstream (arrival -> request sent to the pod), to_client (pod's response head "
                               "-> head sent to the client).", ["stage"], buckets=LATENCY_BUCKETS,
                               registry=self.registry)
        self.first_byte = Histogram("iterserve:router_time_to_first_byte_seconds", "Arrival -> first response "
                                    "body byte sent to the client, the pod's wait included.",
                                    buckets=LATENCY_BUCKETS, registry=self.registry)
        self.to_upstream = self.added.labels("to_upstream")
        self.to_client = self.added.labels("to_client")
        self.registry.register(_PodCollector(pods))

    def render(self) -> bytes:
        return generate_latest(self.registry)
