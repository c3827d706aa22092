"""The tuner inside the operator: one `TuningLoop` per LLMService whose tuning is `observe` or `auto`.

handlers.py runs `run_daemon` as a kopf daemon filtered on the tuning mode: kopf starts it when the
mode becomes observe or auto and stops it when the mode goes back to off or the LLMService is deleted.
kopf itself runs only in the replica holding the leader Lease (operator/leader.py), so only the leader
ticks. Every `spec.tuning.intervalSeconds`, under the LLMService's object lock (so a tick and a
reconcile never interleave), one tick:
- re-reads the spec (a changed SLO, bounds, interval or mode re-configures the Tuner; its memory stays),
  the knobs in force (ConfigMap `<name>-knobs`: when they differ from the Tuner's, someone else changed
  them, e.g. a spec edit the reconcile applied, and the Tuner is told) and the admin token (key `<name>`
  of Secret `iterserve-admin-tokens`);
- lists the ready pods through the API (podIP and the Ready condition, started with that token);
- ticks the Tuner (pods' /metrics, or Prometheus with `--prometheus-url`), told with spec.autoscaling
  whether a scale-out's pods are still coming up (no back-off of max_num_seqs meanwhile); in auto mode a
  change goes to the ConfigMap first (`reconcile.set_tuned_knobs`: new pods start with it), then live to
  every pod;
- labels the pods in or out of the Service's rotation by their queues (pod_rotation.py: in auto mode
  without spec.router; otherwise every pod in);
- writes the status fields and the `Tuned` condition, and returns the Events to emit: one per change
  (or, in observe mode, per new recommendation) and one per transition of `Tuned`.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kubernetes.client.exceptions import ApiException

from iterserve.common.wire import Knobs
from iterserve.operator.background import STOPPED, detach, unless_stopped
from iterserve.operator.builders.configmap import knobs_from_configmap
from iterserve.operator.builders.labels import knobs_configmap_name
from iterserve.operator.builders.secret import ADMIN_SECRET, admin_token_of
from iterserve.operator.conditions import TUNED, get_condition
from iterserve.operator.controller import object_lock, write_tuning_status
from iterserve.operator.kube import Kube
from iterserve.operator.pod_rotation import rotate
from iterserve.operator.reconcile import pod_admin_url, pod_url, ready_pods, set_tuned_knobs, short_error
from iterserve.operator.scaling_loop import Autoscaler, Replicas, replicas_of
from iterserve.operator.spec import LLMService, SpecError, parse_llmservice
from iterserve.operator.status import TUNING_OFF_MESSAGE
from iterserve.operator.tuning.decide import HOLD
from iterserve.operator.tuning.fleet_change import OutsideScale, ScaleOut
from iterserve.operator.tuning.observation import MetricsSource
from iterserve.operator.tuning.observe import PodScraper
from iterserve.operator.tuning.operator_metrics import OperatorMetrics
from iterserve.operator.tuning.policy import InvalidPolicyError, TuningPolicy
from iterserve.operator.tuning.prometheus import PrometheusSource
from iterserve.operator.tuning.scale import SCALE_OUT
from iterserve.operator.tuning.tuner import Tuner, TuningRecord

logger = logging.getLogger("iterserve.operator.tuning")
TUNING_MODES = ("observe", "auto")
RETRY_SECONDS = 5.0  # the wait after a tick that could not run (no ConfigMap or Secret yet, API trouble)
MEASURED_FIELDS = ("ttftP99Ms", "itlP99Ms", "kvCacheUsage")


def tuning_enabled(spec: dict | None) -> bool:
    """The daemon's filter, on the raw spec (an invalid one included: the tick skips it and says nothing,
    the reconcile reports it)."""
    return ((spec or {}).get("tuning") or {}).get("mode", "off") in TUNING_MODES


def policy_from_spec(svc: LLMService) -> TuningPolicy:
    """The Tuner's policy from a validated LLMService: SLO, mode, bounds, interval and window. An objective
    the spec leaves out is infinite (never breached); the other parameters keep TuningPolicy's defaults."""
    bounds = svc.tuning.bounds
    return TuningPolicy(
        ttft_p99_ms=math.inf if svc.ttft_p99_ms is None else svc.ttft_p99_ms,
        itl_p99_ms=math.inf if svc.itl_p99_ms is None else svc.itl_p99_ms,
        mode=svc.tuning.mode,
        max_num_seqs_bounds=(bounds["max_num_seqs"].min, bounds["max_num_seqs"].max),
        prefill_chunk_size_bounds=(bounds["prefill_chunk_size"].min, bounds["prefill_chunk_size"].max),
        interval_s=float(svc.tuning.interval_seconds),
        window_s=float(svc.tuning.window_seconds),
    )


def metrics_source(prometheus_url: str | None, timeout: float,
                   scrape_limit: threading.Semaphore | None = None) -> MetricsSource:
    """Prometheus when the operator was given its URL (pods matched by their `instance` label, the
    podIP:port Kubernetes pod discovery sets), else the pods' own /metrics, at most `scrape_limit`'s
    count in flight across the operator."""
    if prometheus_url:
        return PrometheusSource(prometheus_url, timeout=timeout)
    return PodScraper(timeout=timeout, limit=scrape_limit)


@dataclass
class EventMemory:
    """What was last said about one service, so that a standing verdict or recommendation is one Event."""

    tuned: tuple[str, str] | None = None  # (status, reason) of the Tuned condition last written
    advice: tuple | None = None  # (reason, action, target, knobs in force) of the last non-change Event


def events_for(record: TuningRecord, memory: EventMemory) -> list[dict]:
    """The Events one tick calls for (kopf.event's type, reason, message), updating `memory`: every knob
    change or rollback; a recommendation (observe mode) or failed change when it differs from the last
    one; a transition of the Tuned condition."""
    events = []
    event = record.event()
    if event is not None:
        if event["reason"] in ("KnobsChanged", "KnobsRolledBack"):
            events.append(event)
            memory.advice = None
        else:
            key = (event["reason"], record.decision.action, record.decision.knobs, record.knobs)
            if key != memory.advice:
                events.append(event)
            memory.advice = key
    elif record.decision.action == HOLD and record.decision.slo_met:
        memory.advice = None  # the SLO is met where it stands: a later recommendation is news again
    condition = record.condition()
    tuned = (condition["status"], condition["reason"])
    if tuned != memory.tuned:
        memory.tuned = tuned
        warn = condition["status"] == "False" and condition["reason"] in ("BoundsReached", "NoBetterSetting")
        message = f"Tuned={condition['status']}" + (f": {condition['message']}" if condition["message"] else "")
        events.append({"type": "Warning" if warn else "Normal", "reason": condition["reason"], "message": message})
    return events


def next_delay(interval_s: float, elapsed_s: float) -> float:
    """Seconds to wait so that ticks start every `interval_s` (at once when a tick overran)."""
    return max(0.0, interval_s - elapsed_s)


@dataclass
class TuningLoop:
    """One LLMService's Tuner and what the operator keeps around it between ticks."""

    kube: Kube
    namespace: str
    name: str
    source: MetricsSource
    metrics: OperatorMetrics | None = None
    pod_timeout: float = 3.0
    tuner: Tuner | None = None
    memory: EventMemory = field(default_factory=EventMemory)
    autoscaler: Autoscaler = field(default_factory=Autoscaler)
    outside: OutsideScale = field(default_factory=OutsideScale)  # the fleet, sized outside the operator
    interval_s: float = RETRY_SECONDS
    _svc: LLMService | None = field(default=None, repr=False)
    _token: str | None = field(default=None, repr=False)
    _pods: dict[str, dict] = field(default_factory=dict, repr=False)  # pod URL -> the pod, as listed this tick

    def run_once(self, body: dict) -> tuple[float, list[dict]]:
        """One tick for the LLMService as `body` shows it now: (seconds to the next tick, Events to emit)."""
        started = time.monotonic()
        try:
            record, scale_events = self._tick(body)
        except (ApiException, RuntimeError) as e:  # the API server's trouble: try again next time
            logger.warning("%s/%s: tuning tick failed: %s", self.namespace, self.name, short_error(e))
            return RETRY_SECONDS, []
        except Exception:  # e.g. the API server unreachable; a tick never ends the daemon and its memory
            logger.exception("%s/%s: tuning tick failed", self.namespace, self.name)
            return RETRY_SECONDS, []
        if record is None:
            return RETRY_SECONDS, []
        events = events_for(record, self.memory) + scale_events
        return next_delay(self.interval_s, time.monotonic() - started), events

    def _tick(self, body: dict) -> tuple[TuningRecord | None, list[dict]]:
        """The tuner's tick, then (spec.autoscaling) the autoscaler's on the same window: (record, the
        autoscaler's Events). The tuner asks the autoscaler first whether it grows the fleet on its move."""
        ns, name = self.namespace, self.name
        with object_lock(ns, name):
            try:
                svc = parse_llmservice(body)
                policy = policy_from_spec(svc)
            except (SpecError, InvalidPolicyError):
                return None, []  # the reconcile reports it; the last good setting keeps serving
            self.interval_s = policy.interval_s
            if policy.mode not in TUNING_MODES:
                return None, []  # the daemon is being stopped
            knobs = knobs_from_configmap(self.kube.get("v1", "ConfigMap", ns, knobs_configmap_name(name)))
            token = admin_token_of(self.kube.get("v1", "Secret", ns, ADMIN_SECRET), name)
            if knobs is None or token is None:
                return None, []  # not created yet: the reconcile is on it
            in_force = Knobs.from_dict(knobs)
            tuner = self._tuner(svc, policy, in_force, token)
            seen, scale_out, scales_out = None, None, None
            conflicts: tuple[str, ...] = ()
            if svc.autoscaling is None:
                self.autoscaler = Autoscaler()  # turned off: a later spec.autoscaling starts afresh
                scale_out = self._outside_scale_out(svc, policy)
            else:  # desiredReplicas is the autoscaler's alone: read before the tuner's status write, it holds
                self.outside = OutsideScale()
                seen = replicas_of(self.kube, svc, (self.kube.get_llmservice(ns, name) or {}).get("status"))
                scale_out = self.autoscaler.scale_out_in_flight(svc, seen, policy)
                conflicts = self.autoscaler.conflicts(self.kube, svc)
                scales_out = self._scales_out(svc, seen, policy, conflicts)
            record = tuner.tick(scale_out=scale_out, scales_out=scales_out)
            if seen is None and record.observation is not None:
                self.outside = self.outside.queue(record.observation.queued, record.time)
            self._rotate(svc, record)
            if not write_tuning_status(self.kube, ns, name, record.status(), record.condition()):
                return None, []  # deleted meanwhile
            if seen is None:
                return record, []
            return record, self.autoscaler.tick(self.kube, svc, seen, record, policy, conflicts)

    def _scales_out(self, svc: LLMService, seen: Replicas, policy: TuningPolicy,
                    conflicts: tuple[str, ...]) -> Callable[[TuningRecord], bool]:
        """Whether the autoscaler grows the fleet on a tuner's record, for the tuner's second look at its
        move (fleet_change.second_look): the scaler's decision on it, its state untouched."""
        return lambda record: self.autoscaler.decide(svc, seen, record, policy, conflicts).action == SCALE_OUT

    def _tuner(self, svc: LLMService, policy: TuningPolicy, in_force: Knobs, token: str) -> Tuner:
        """The Tuner, created on the first tick, brought up to date with the spec and the knobs in force."""
        self._svc, self._token = svc, token
        if self.tuner is None:
            self.tuner = Tuner(self.namespace, self.name, list_pods=self._list_pods, admin_token=lambda: self._token,
                               policy=policy, source=self.source, knobs=in_force, apply_knobs=self._apply_knobs,
                               metrics=self.metrics, timeout=self.pod_timeout,
                               admin_url=self._admin_url)
            return self.tuner
        tuner = self.tuner
        if policy != tuner.policy:
            tuner.set_policy(policy)
        if in_force != tuner.state.knobs:
            # changed outside the tuner: a spec edit (or a mode change) the reconcile put in force
            logger.info("%s/%s: knobs in force are now %s (set outside the tuner)", self.namespace, self.name,
                        in_force.describe())
            tuner.set_knobs(in_force)
        return tuner

    def _outside_scale_out(self, svc: LLMService, policy: TuningPolicy) -> ScaleOut | None:
        """What a scale-out made outside the operator (an HPA or KEDA on the scale subresource, a person)
        waits for (fleet_change.OutsideScale): spec.replicas against the ready pods the last tick listed
        (no read of the Deployment more per tick; the start is seen to end a tick late)."""
        now = time.time()
        self.outside = self.outside.see(svc.replicas, len(self._pods), now)
        return self.outside.in_flight(len(self._pods), policy.window_s, now)

    def _list_pods(self) -> list[str]:
        self._pods = {pod_url(pod): pod for pod in ready_pods(self.kube, self._svc, self._token)}
        return list(self._pods)

    def _admin_url(self, url: str) -> str:
        """A listed pod's admin API (its `admin` port)."""
        return pod_admin_url(self._pods[url]) if url in self._pods else url

    def _rotate(self, svc: LLMService, record: TuningRecord) -> None:
        """Rotation (pod_rotation.py) on the queues the tick read; a source without per-pod readings
        (Prometheus) leaves every pod in."""
        waiting = self.source.waiting_now(list(self._pods), record.time) if isinstance(self.source, PodScraper) else {}
        try:
            obs = record.observation
            per_pod = obs.request_rate / obs.num_pods if obs is not None and obs.num_pods else 0.0
            out, _ = rotate(self.kube, svc, self._pods, waiting, per_pod, self.interval_s)
            if self.metrics is not None:
                self.metrics.set_out_of_rotation(self.namespace, self.name, len(out))
        except (ApiException, RuntimeError) as e:  # a pod gone meanwhile: the next tick lists afresh
            logger.warning("%s/%s: rotation: %s", self.namespace, self.name, short_error(e))

    def _apply_knobs(self, knobs: Knobs) -> None:
        set_tuned_knobs(self.kube, self._svc, knobs.as_dict())

    def close(self) -> None:
        """The daemon stopped: drop the service's metric series; when tuning was turned off (not deleted,
        not an operator exiting), clear the measurements that would otherwise stand in the status."""
        if self.metrics is not None:
            self.metrics.forget(self.namespace, self.name)
        try:
            with object_lock(self.namespace, self.name):  # a daemon started since (mode back on) goes first
                current = self.kube.get_llmservice(self.namespace, self.name)
                if current is None or current["metadata"].get("deletionTimestamp") or \
                        tuning_enabled(current.get("spec")):
                    return
                write_tuning_status(self.kube, self.namespace, self.name, dict.fromkeys(MEASURED_FIELDS),
                                    {"status": "False", "reason": "TuningOff", "message": TUNING_OFF_MESSAGE})
        except (ApiException, RuntimeError) as e:
            logger.warning("%s/%s: clearing the tuner's status: %s", self.namespace, self.name, short_error(e))


def tuned_of(body) -> tuple[str, str] | None:
    """(status, reason) of the Tuned condition `body` carries."""
    condition = get_condition(((body or {}).get("status") or {}).get("conditions"), TUNED)
    return None if condition is None else (condition.get("status"), condition.get("reason"))


async def run_daemon(kube: Kube, body, stopped, *, emit: Callable[[dict], None], prometheus_url: str | None = None,
                     metrics: OperatorMetrics | None = None, pod_timeout: float = 3.0,
                     scrape_limit: threading.Semaphore | None = None) -> None:
    """Tick one LLMService until `stopped` (kopf's DaemonStopped) is set. `body` is the live object (kopf
    keeps a daemon's body up to date); `emit(event)` posts an Event on it. Async, and each tick (blocking
    HTTP) in a thread of its own: between ticks the daemon holds no thread, so any number of tuned
    services leaves kopf's workers to the reconciles."""
    meta = body["metadata"]
    loop = TuningLoop(kube, meta["namespace"], meta["name"], metrics_source(prometheus_url, pod_timeout, scrape_limit),
                      metrics, pod_timeout, memory=EventMemory(tuned=tuned_of(body)))
    logger.info("%s/%s: tuner started (%s)", loop.namespace, loop.name,
                f"Prometheus at {prometheus_url}" if prometheus_url else "reading the pods' /metrics")
    try:
        while not stopped.is_set():
            outcome = await unless_stopped(stopped, loop.run_once, body)
            if outcome is STOPPED:
                break  # the tick under way finishes alone: kopf's deletion must not wait for a hung pod
            delay, events = outcome
            for event in events:
                emit(event)
            await stopped.wait(delay)
    finally:
        # not awaited: an exit that is not immediate makes kopf hold the deletion for the daemon's back-off
        detach(loop.close)
        logger.info("%s/%s: tuner stopped", loop.namespace, loop.name)
