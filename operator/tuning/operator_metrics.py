"""The operator's own Prometheus metrics: tuning decisions, the knobs in force and what was measured,
per service, on a registry of their own that the operator serves (`render()` gives the text format)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from iterserve.common.wire import Knobs

SERVICE = ["namespace", "service"]
TUNED_VALUE = {"True": 1.0, "False": 0.0, "Unknown": -1.0}


class OperatorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = r = registry or CollectorRegistry()
        self.decisions = Counter("iterserve_operator_tuning_decisions", "Tuning decisions taken, by action "
                                 "(hold included).", SERVICE + ["action"], registry=r)
        self.changes = Counter("iterserve_operator_knob_changes", "Knob changes applied to a service's pods.",
                               SERVICE, registry=r)
        self.errors = Counter("iterserve_operator_tuning_errors", "Pods not read or not patched, and failed "
                              "ConfigMap writes, during tuning.", SERVICE, registry=r)
        self.knob = Gauge("iterserve_operator_knob", "Scheduler knob in force on a service's pods.",
                          SERVICE + ["knob"], registry=r)
        self.p99 = Gauge("iterserve_operator_observed_p99_seconds", "p99 over the last window the tuner judged.",
                         SERVICE + ["metric"], registry=r)
        self.kv_usage = Gauge("iterserve_operator_observed_kv_cache_usage", "Highest per-pod KV cache usage "
                              "(0..1) over the last window.", SERVICE, registry=r)
        self.tuned = Gauge("iterserve_operator_tuned", "The Tuned condition: 1 True, 0 False, -1 Unknown.",
                           SERVICE, registry=r)
        self.out_of_rotation = Gauge("iterserve_operator_pods_out_of_rotation", "Ready pods the operator has "
                                     "taken out of the Service's rotation while their queue drains.", SERVICE,
                                     registry=r)
        self._children: dict[tuple[str, str], set] = {}  # service -> (metric, label values) it has, for forget

    def _child(self, metric, namespace: str, name: str, *more: str):
        self._children.setdefault((namespace, name), set()).add((metric, (namespace, name, *more)))
        return metric.labels(namespace, name, *more)

    def record(self, record) -> None:
        """Take in one TuningRecord."""
        service = (record.namespace, record.name)
        self._child(self.decisions, *service, record.decision.action).inc()
        if record.changed:
            self._child(self.changes, *service).inc()
        if record.errors:
            self._child(self.errors, *service).inc(len(record.errors))
        self.set_knobs(*service, record.knobs)
        obs = record.observation
        if obs is not None and obs.num_samples:
            for metric, value in (("ttft", obs.ttft_p99_s), ("itl", obs.itl_p99_s)):
                if value is not None:
                    self._child(self.p99, *service, metric).set(value)
            self._child(self.kv_usage, *service).set(obs.kv_usage)
        self._child(self.tuned, *service).set(TUNED_VALUE.get(record.decision.tuned.status, -1.0))

    def set_knobs(self, namespace: str, name: str, knobs: Knobs) -> None:
        for knob, value in knobs.as_dict().items():
            self._child(self.knob, namespace, name, knob).set(value)

    def set_out_of_rotation(self, namespace: str, name: str, pods: int) -> None:
        self._child(self.out_of_rotation, namespace, name).set(pods)

    def forget(self, namespace: str, name: str) -> None:
        """Drop every series of a deleted service."""
        for metric, labels in self._children.pop((namespace, name), set()):
            metric.remove(*labels)

    def render(self) -> bytes:
        return generate_latest(self.registry)
