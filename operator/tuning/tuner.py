"""`Tuner`: observe, decide and act for ONE service, with no Kubernetes in sight.

The operator gives it a way to list the ready pods' base URLs (and to map each to its admin API), the
admin token, a policy, a metrics source (`PodScraper` or `PrometheusSource`) and an `apply_knobs`
callback that makes new pods start with the tuned values (the operator writes the `<name>-knobs`
ConfigMap there). Each `tick` observes the window since the last change, runs `decide`, and in `auto`
mode applies a change first through `apply_knobs`, then live on every ready pod (PATCH
/admin/scheduler: no restart, no rollout). A pod that was not reached, or that appeared since, is
brought to the knobs in force on a later tick. The returned `TuningRecord` holds everything the
operator writes to the LLMService status, the `Tuned` condition and the Event to emit.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone

from iterserve.common.wire import Knobs
from iterserve.operator.tuning.decide import HOLD, ROLLBACK, Decision, TunerState, decide
from iterserve.operator.tuning.fleet_change import ScaleOut, second_look
from iterserve.operator.tuning.observation import MetricsSource, Observation
from iterserve.operator.tuning.pod_admin import PodCallError, get_scheduler, patch_scheduler
from iterserve.operator.tuning.policy import TuningPolicy

logger = logging.getLogger("iterserve.operator.tuning")


def rfc3339(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class TuningRecord:
    """One tick's outcome, ready for the LLMService status."""

    namespace: str
    name: str
    time: float
    knobs: Knobs  # in force after this tick
    observation: Observation | None
    decision: Decision
    changed: bool  # the knobs were changed on the pods this tick
    errors: tuple[str, ...] = ()  # pods not read or not patched, a failed apply_knobs

    def status(self) -> dict:
        """The LLMService status fields the tuner owns (camelCase), without the conditions list."""
        obs = self.observation
        ms = lambda s: None if s is None else round(s * 1000, 1)  # noqa: E731
        return {
            "knobs": self.knobs.as_camel(),
            "ttftP99Ms": ms(obs.ttft_p99_s) if obs else None,
            "itlP99Ms": ms(obs.itl_p99_s) if obs else None,
            "kvCacheUsage": round(obs.kv_usage, 4) if obs and obs.num_pods else None,
            "lastDecision": {"action": self.decision.action, "reason": self.decision.reason,
                             "time": rfc3339(self.decision.time)},
        }

    def condition(self) -> dict:
        """The `Tuned` condition (the operator keeps lastTransitionTime when the status did not change)."""
        c = self.decision.tuned
        return {"type": "Tuned", "status": c.status, "reason": c.reason, "message": c.message,
                "lastTransitionTime": rfc3339(self.time)}

    def event(self) -> dict | None:
        """The Event for a change (or, in observe mode, a recommendation); None when nothing moved."""
        d = self.decision
        if d.knobs is None or d.action == HOLD:
            return None
        if self.changed:
            reason = "KnobsRolledBack" if d.action == ROLLBACK else "KnobsChanged"
            return {"type": "Warning" if d.action == ROLLBACK else "Normal", "reason": reason,
                    "message": f"{d.action}: {d.knobs.describe()} ({d.reason})"}
        if not d.applied:
            return {"type": "Normal", "reason": "KnobsRecommended",
                    "message": f"{d.action}: {d.knobs.describe()} ({d.reason})"}
        return {"type": "Warning", "reason": "KnobsNotApplied",
                "message": f"{d.action} to {d.knobs.describe()} failed: {'; '.join(self.errors)}"}


class Tuner:
    def __init__(self, namespace: str, name: str, *, list_pods: Callable[[], Sequence[str]],
                 admin_token: str | Callable[[], str], policy: TuningPolicy, source: MetricsSource, knobs: Knobs,
                 apply_knobs: Callable[[Knobs], None] | None = None, metrics=None,
                 clock: Callable[[], float] = time.time, timeout: float = 5.0,
                 admin_url: Callable[[str], str] | None = None):
        self.namespace, self.name = namespace, name
        self.list_pods = list_pods
        # a pod's admin API from its URL (pods that serve /admin on a port of their own); default: the same
        self.admin_url = admin_url or (lambda url: url)
        self._admin_token = admin_token
        self.policy = policy
        self.source = source
        self.apply_knobs = apply_knobs
        self.metrics = metrics  # an OperatorMetrics, or None
        self.clock = clock
        self.timeout = timeout
        self.state = TunerState(knobs)
        self.synced: set[str] = set()  # pods known to run the knobs in force

    @property
    def admin_token(self) -> str:
        return self._admin_token() if callable(self._admin_token) else self._admin_token

    def set_policy(self, policy: TuningPolicy) -> None:
        """A new policy (the LLMService's slo or tuning changed); the state, with its memory, is kept."""
        self.policy = policy

    def set_knobs(self, knobs: Knobs, now: float | None = None) -> None:
        """The knobs were changed outside the tuner (a spec edit applied by the operator): they are in force
        now, the next window starts after them and the cooldown runs from here."""
        now = self.clock() if now is None else now
        self.state = dataclasses.replace(self.state, knobs=knobs, last_change_time=now, pending=None,
                                         recent_knobs=(), previous_action=None, chunk_before_cheap_raise=None)
        self.synced.clear()

    def tick(self, now: float | None = None, scale_out: ScaleOut | None = None,
             scales_out: Callable[[TuningRecord], bool] | None = None) -> TuningRecord:
        """`scale_out`: what a scale-out in flight waits for (`fleet_change.scale_out_in_flight`), or None.
        `scales_out`: whether the scaler, which ticks after the tuner, grows the fleet on this tick's record
        if it is as given (the move not yet applied): a move it would is looked at again (`second_look`)."""
        now = self.clock() if now is None else now
        pods = list(self.list_pods())
        errors: list[str] = []
        if self.policy.mode == "auto":
            errors += self._sync(pods, self.state.knobs)
        obs = None
        if self.policy.mode != "off":
            obs = self.source.observe(pods, now, self.policy.window_s, since=self.state.last_change_time)
            errors += list(obs.errors) if obs else []
        before = self.state.tuned
        decision = decide(self.state, obs, self.policy, now, scale_out)
        if scales_out is not None:
            decision = second_look(
                decision, scale_out, obs.queued if obs is not None else None,
                lambda again: decide(self.state, obs, self.policy, now, again),
                lambda d: scales_out(TuningRecord(self.namespace, self.name, now, d.state.knobs, obs, d, d.applied)))
        changed = False
        if decision.applied and decision.knobs is not None:
            changed, apply_errors = self._apply(pods, decision.knobs)
            errors += apply_errors
        if changed or not decision.applied:
            self.state = decision.state
        record = TuningRecord(self.namespace, self.name, now, self.state.knobs, obs, decision, changed,
                              tuple(errors))
        if decision.action != HOLD or errors:
            logger.info("%s/%s: %s -> %s (%s)%s", self.namespace, self.name, decision.action,
                        self.state.knobs.describe(), decision.reason, f"; errors: {errors}" if errors else "")
        elif ((after := self.state.tuned).status, after.reason) != (before.status, before.reason):
            # a verdict that turned without a move: the Event says it too, the log keeps it beside the moves
            logger.info("%s/%s: Tuned %s/%s -> %s/%s: %s", self.namespace, self.name, before.status, before.reason,
                        after.status, after.reason, after.message)
        if self.metrics is not None:
            self.metrics.record(record)
        return record

    def _apply(self, pods: list[str], knobs: Knobs) -> tuple[bool, list[str]]:
        """ConfigMap first (new pods), then every ready pod live. Committed when the ConfigMap took it and
        at least one pod (or no pod at all) did; else the old values are put back and the state kept."""
        if self.apply_knobs is not None:
            try:
                self.apply_knobs(knobs)
            except Exception as e:  # the operator's write failed: nothing changed anywhere
                return False, [f"apply_knobs: {type(e).__name__}: {e}"]
        self.synced.clear()
        errors = self._sync(pods, knobs, known_differ=True)
        if pods and len(errors) == len(pods):
            if self.apply_knobs is not None:
                try:
                    self.apply_knobs(self.state.knobs)
                except Exception as e:
                    errors.append(f"apply_knobs (restoring): {type(e).__name__}: {e}")
            return False, errors
        self.source.snapshot(pods, self.clock())  # the next window starts after the change
        return True, errors

    def _sync(self, pods: list[str], knobs: Knobs, known_differ: bool = False) -> list[str]:
        """Bring pods not known to run `knobs` to them; returns one error per pod that could not be."""
        self.synced &= set(pods)
        errors = []
        want = knobs.as_dict()
        for url in pods:
            if url in self.synced:
                continue
            try:
                admin = self.admin_url(url)
                if known_differ or get_scheduler(admin, self.admin_token, self.timeout)["knobs"] != want:
                    patch_scheduler(admin, self.admin_token, want, self.timeout)
                self.synced.add(url)
            except PodCallError as e:
                errors.append(str(e))
        return errors
