"""kopf handlers: decorators only; the work is in operator/controller.py and operator/reconcile.py.

- create / update / resume of an LLMService: a full reconcile (children, live knobs, status);
- a timer per LLMService (`ITERSERVE_OPERATOR_RESYNC_SECONDS`, default 30): the same reconcile, which
  puts back deleted or edited children and pods that missed a knob change;
- Deployments the operator manages: a status refresh when their status changes (Ready follows the
  pods without waiting for the timer) and a full reconcile of the owner when one is deleted, or when a
  router's Deployment gets its first ready pod or loses its last (the Service follows the router);
- a daemon per LLMService whose tuning is observe or auto (operator/tuning_loop.py): the tuner, ticking
  every spec.tuning.intervalSeconds; kopf stops it when the mode goes to off or the object is deleted;
- at start: the thread pool the timer and the daemon use, the operator-wide bound on the tuners' scrapes in
  flight, the label-selected watches of the children (operator/child_watch.py; stopped at cleanup) and
  the heartbeat behind /healthz.

Run with `iterserve operator` (operator/cli.py) or `kopf run -m iterserve.operator.handlers`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import kopf
import kubernetes

from iterserve.operator import background, controller, tuning_loop
from iterserve.operator.builders.labels import MANAGED_BY, MANAGED_BY_LABEL
from iterserve.operator.builders.networkpolicy import OperatorPeer
from iterserve.operator.child_watch import start_child_watches, watched_kinds
from iterserve.operator.constants import (
    DEFAULT_MAX_CONCURRENT_SCRAPES,
    DEFAULT_OPERATOR_NAMESPACE,
    GROUP,
    KIND,
    PLURAL,
    VERSION,
)
from iterserve.operator.health import BEAT_EVERY_S
from iterserve.operator.kube import Kube
from iterserve.operator.reconcile import router_serving
from iterserve.operator.tuning.operator_metrics import OperatorMetrics

RESYNC_SECONDS = float(os.environ.get("ITERSERVE_OPERATOR_RESYNC_SECONDS", "30"))
POD_TIMEOUT_SECONDS = float(os.environ.get("ITERSERVE_OPERATOR_POD_TIMEOUT", "3"))
RETRY_DELAY_SECONDS = 10
# How long kopf waits for the timer and daemon to exit when an LLMService is deleted before it falls back
# to re-checking after their back-off (60 s for a timer). Both exit at once (operator/background.py);
# this is slack for an event loop on a busy machine.
INSTANT_EXIT_SECONDS = 0.5
BACKGROUND_THREADS = 32
# kopf's handler threads: how many create/update passes run at once. A fleet-wide edit queues one pass per
# LLMService behind them, and a pass mostly waits on API round trips: 200 changes at once had a p99 of 4.06 s
# with 8, a median p99 of 1.49 s over three runs with 32 (docs/benchmarks-operator.md, "A fleet-wide edit").
KOPF_WORKERS = int(os.environ.get("ITERSERVE_OPERATOR_WORKERS", "32"))


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_) -> None:
    # kopf's bookkeeping in annotations under our prefix: the CRD's structural schema would prune a
    # `status.kopf` field.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="iterserve.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="iterserve.io", key="last-handled-configuration")
    # our own Events say what happened (kopf.event, unfiltered); kopf's log-based ones only for failures
    settings.posting.level = logging.WARNING
    settings.execution.max_workers = KOPF_WORKERS
    settings.background.instant_exit_timeout = INSTANT_EXIT_SECONDS
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per pod call drowns the log
    # Watching chosen namespaces: take their names as given rather than list the cluster's namespaces,
    # which would need cluster-wide rights on namespaces for nothing.
    settings.scanning.disabled = bool(getattr(memo, "namespaces", None))
    namespaces = list(getattr(memo, "namespaces", None) or [])
    if getattr(memo, "kube", None) is None:
        kubernetes.config.load_config()
        config = kubernetes.client.Configuration.get_default_copy()
        # a connection per thread that calls the API at once (kopf's workers, the resync passes, the tuners'
        # ticks) and one held by each child watch: urllib3's default (5 per CPU) made those threads open a
        # new TLS connection per request
        watches = len(watched_kinds("policy/v1")) * max(1, len(namespaces))
        config.connection_pool_maxsize = BACKGROUND_THREADS + KOPF_WORKERS + watches
        memo.kube = Kube(kubernetes.client.ApiClient(config))
    # label-selected watches of the children, read by every pass instead of a GET each (child_watch.py)
    if not getattr(memo, "child_watches", None):
        memo.child_watches = start_child_watches(memo.kube, namespaces)
    if getattr(memo, "operator_metrics", None) is None:  # `iterserve operator` passes the one it serves
        memo.operator_metrics = OperatorMetrics()
    if getattr(memo, "operator_peer", None) is None:  # `iterserve operator` passes its flags'
        memo.operator_peer = OperatorPeer(namespace=os.environ.get("POD_NAMESPACE") or DEFAULT_OPERATOR_NAMESPACE)
    if getattr(memo, "scrape_limit", None) is None:  # `iterserve operator` passes --max-concurrent-scrapes'
        memo.scrape_limit = threading.BoundedSemaphore(DEFAULT_MAX_CONCURRENT_SCRAPES)


@kopf.on.startup()
async def start_background(memo: kopf.Memo, **_) -> None:
    # Resync passes and tuner ticks run in the event loop's default executor (operator/background.py),
    # and a pass abandoned on a hung pod holds its thread until its timeouts: asyncio's default size
    # (CPUs + 4) is small on a small node.
    asyncio.get_running_loop().set_default_executor(
        ThreadPoolExecutor(max_workers=BACKGROUND_THREADS, thread_name_prefix="iterserve-background"))
    # beats from kopf's own event loop: /healthz goes stale when the loop stops turning (operator/health.py)
    health = getattr(memo, "health", None)
    if health is not None:
        memo.heartbeat_task = asyncio.create_task(_beat(health))


@kopf.on.cleanup()
def stop_child_watches(memo: kopf.Memo, **_) -> None:
    for watch in getattr(memo, "child_watches", None) or ():
        watch.stop()


@kopf.on.cleanup()
async def stop_heartbeat(memo: kopf.Memo, **_) -> None:
    # kopf gives the tasks still running at exit 5 s before it cancels them: every stop would take that long
    task = getattr(memo, "heartbeat_task", None)
    if task is not None:
        task.cancel()


async def _beat(health) -> None:
    while True:
        health.beat("operating")
        await asyncio.sleep(BEAT_EVERY_S)


def _report(body, result: controller.Result, *, drift: bool) -> None:
    for change in result.changes:
        reason = {"created": "Created", "deleted": "Deleted", "live": "KnobsApplied"}.get(
            change.action, "DriftRepaired" if drift else "Updated")
        kopf.event(body, type="Normal", reason=reason, message=str(change))
    for condition in result.transitions:
        bad = condition["type"] == "Degraded" and condition["status"] == "True"
        message = f"{condition['type']}={condition['status']}"
        if condition.get("message"):
            message += f": {condition['message']}"
        kopf.event(body, type="Warning" if bad else "Normal", reason=condition["reason"], message=message)


@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
@kopf.on.resume(GROUP, VERSION, PLURAL)
def reconcile_llmservice(body, memo: kopf.Memo, **_) -> None:
    result = controller.handle(memo.kube, body, pod_timeout=POD_TIMEOUT_SECONDS, operator=memo.operator_peer)
    _report(body, result, drift=False)
    if result.spec_error is not None:
        if not any(c["type"] == "Degraded" for c in result.transitions):  # else that Event said it
            kopf.event(body, type="Warning", reason="InvalidSpec", message=str(result.spec_error))
        raise kopf.PermanentError(f"invalid spec: {result.spec_error}")  # retried when the spec changes
    if result.problems and not result.gone:
        # status (Degraded) and the Degraded Event carry the details; kopf retries the whole pass
        raise kopf.TemporaryError("; ".join(result.problems), delay=RETRY_DELAY_SECONDS)


# Async, with the pass in a thread it does not wait for once the object is deleted (operator/background.py):
# a pass hung on an unresponsive pod must not hold the deletion.
# kopf's TimerFn protocol lists every keyword kopf passes; this handler takes the ones it uses and **_
@kopf.timer(GROUP, VERSION, PLURAL, interval=RESYNC_SECONDS, initial_delay=RESYNC_SECONDS)  # type: ignore[arg-type]
async def repair_drift(body, memo: kopf.Memo, stopped: kopf.DaemonStopped, **_) -> None:
    result = await background.unless_stopped(stopped, controller.handle, memo.kube, body,
                                             pod_timeout=POD_TIMEOUT_SECONDS, operator=memo.operator_peer)
    if result is not background.STOPPED:
        _report(body, result, drift=True)  # problems persist in status; Degraded's transition is the Event


def _readiness_changed(memo: kopf.Memo, body) -> bool:
    """Whether this router Deployment went from no ready pod to some, or back, since its last event."""
    seen = memo.setdefault("router_serving", {})  # kopf's Memo is a dict
    key = (body["metadata"]["namespace"], body["metadata"]["name"])
    serving = router_serving(body)
    changed = seen.get(key) != serving
    seen[key] = serving
    return changed


def _owner(body) -> tuple[str, str] | None:
    for ref in body.get("metadata", {}).get("ownerReferences") or ():
        if ref.get("kind") == KIND and ref.get("apiVersion", "").startswith(GROUP + "/") and ref.get("controller"):
            return body["metadata"]["namespace"], ref["name"]
    return None


@kopf.on.event("apps", "v1", "deployments", labels={MANAGED_BY_LABEL: MANAGED_BY})
def deployment_changed(event, body, memo: kopf.Memo, **_) -> None:
    owner = _owner(body)
    if owner is None:
        return
    namespace, name = owner
    # a router's readiness decides where the Service sends clients: that takes a full pass, not a refresh
    router = body["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "router"
    deleted = event.get("type") == "DELETED"
    if deleted or (router and _readiness_changed(memo, body)):
        llmservice = memo.kube.get_llmservice(namespace, name)
        if llmservice is None or llmservice["metadata"].get("deletionTimestamp"):
            return  # deleted with its owner: garbage collection, nothing to repair
        result = controller.handle(memo.kube, llmservice, pod_timeout=POD_TIMEOUT_SECONDS,
                                   operator=memo.operator_peer)
        _report(llmservice, result, drift=deleted)
        return
    result = controller.refresh_status(memo.kube, namespace, name)
    if not result.gone and result.transitions:
        llmservice = memo.kube.get_llmservice(namespace, name)
        if llmservice is not None:
            _report(llmservice, result, drift=False)


# An async daemon: each tick runs in a thread of its own (tuning_loop.run_daemon); between ticks it holds
# none, so tuned services do not take kopf's workers from the reconciles. On a stop it returns at once,
# leaving a tick under way to finish alone.
@kopf.daemon(GROUP, VERSION, PLURAL, id="tuner", when=lambda spec, **_: tuning_loop.tuning_enabled(spec))
async def tune(body, memo: kopf.Memo, stopped: kopf.DaemonStopped, **_) -> None:
    await tuning_loop.run_daemon(memo.kube, body, stopped, emit=lambda event: kopf.event(body, **event),
                                 prometheus_url=getattr(memo, "prometheus_url", None),
                                 metrics=memo.operator_metrics, pod_timeout=POD_TIMEOUT_SECONDS,
                                 scrape_limit=memo.scrape_limit)
