"""What the operator scale test (benchmarks/operator_scale.py) runs around the operator on a real
apiserver: the pods' Ready marker, a watch that timestamps status.observedGeneration, and readers of the
apiserver's request counters and a process's memory.

No kubelet runs the pods: `PodMarker` plays the scheduler and kubelet as far as the operator can tell.
It binds each new pod of an LLMService, gives it a loopback address of its own (the podIP), asks the
metrics stand-in (benchmarks/metrics_standin.py) to serve that address, and writes a Running, Ready status
(tests/kubelet_status.py, the same status the tests' kubelet stand-in writes). A deleted pod is removed
at once, as a kubelet does once its process is gone.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter

import httpx
import kubernetes
from prometheus_client.parser import text_string_to_metric_families

from iterserve.operator.builders.labels import ADMIN_PORT, HTTP_PORT, MANAGED_BY
from iterserve.operator.constants import GROUP, PLURAL, VERSION
from tests.kubelet_standin import allocate_host
from tests.kubelet_status import PodState, pod_status

POD_SELECTOR = f"app.kubernetes.io/managed-by={MANAGED_BY}"
NODE_NAME = "fleet-0"
WATCH_SECONDS = 300  # each watch call's server-side timeout; the loops re-open it


def _watch_forever(list_call, stopped: threading.Event, on_event, **kwargs) -> None:
    """Re-open a watch until `stopped`; a broken one is re-opened after a pause (the re-list replays
    ADDED events, which every handler here takes as they come)."""
    while not stopped.is_set():
        try:
            for event in kubernetes.watch.Watch().stream(list_call, timeout_seconds=WATCH_SECONDS, **kwargs):
                on_event(event)
                if stopped.is_set():
                    return
        except Exception as e:  # noqa: BLE001  (a harness thread must outlive the apiserver's hiccups)
            if not stopped.is_set():
                print(f"fleet harness: watch re-opened after {type(e).__name__}: {e}", flush=True)
                time.sleep(1.0)


class WatchThread:
    """A watch handled in a thread of its own, each event by `_on_event`, until `stop()`."""

    def __init__(self, list_call, **kwargs):
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=_watch_forever, args=(list_call, self._stopped, self._on_event),
                                        kwargs=kwargs, name=type(self).__name__, daemon=True)

    def start(self):
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()

    def _on_event(self, event: dict) -> None:
        raise NotImplementedError


class PodMarker(WatchThread):
    def __init__(self, api_client, standin_url: str, standin_pid: int):
        self.core = kubernetes.client.CoreV1Api(api_client)
        super().__init__(self.core.list_pod_for_all_namespaces, label_selector=POD_SELECTOR)
        self.standin_url = standin_url
        self.standin_pid = standin_pid
        self.hosts: dict[str, tuple[str, str]] = {}  # podIP -> (namespace, LLMService)
        self._marked: set[tuple[str, str]] = set()

    def _on_event(self, event: dict) -> None:
        pod = event["raw_object"]
        meta = pod["metadata"]
        key = (meta["namespace"], meta["name"])
        try:
            if event["type"] == "DELETED":
                self._marked.discard(key)
            elif meta.get("deletionTimestamp"):
                self.core.delete_namespaced_pod(meta["name"], meta["namespace"], grace_period_seconds=0)
            elif key not in self._marked and not (pod.get("status") or {}).get("podIP"):
                self._mark_ready(pod)
                self._marked.add(key)
        except kubernetes.client.ApiException as e:
            if e.status not in (404, 409):  # gone meanwhile, or bound / written by an earlier pass
                print(f"fleet harness: pod {key}: HTTP {e.status}: {e.reason}", flush=True)

    def _mark_ready(self, pod: dict) -> None:
        meta = pod["metadata"]
        host = allocate_host(HTTP_PORT, ADMIN_PORT)
        httpx.post(f"{self.standin_url}/listen", json={"host": host}, timeout=30).raise_for_status()
        binding = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": meta["name"]},
                   "target": {"apiVersion": "v1", "kind": "Node", "name": NODE_NAME}}
        try:  # _preload_content=False: the client cannot parse the answer (a Binding without `target`)
            self.core.create_namespaced_pod_binding(meta["name"], meta["namespace"], binding, _preload_content=False)
        except kubernetes.client.ApiException as e:
            if e.status != 409:  # 409: already bound
                raise
        container = pod["spec"]["containers"][0]
        state = PodState(container_name=container["name"], image=container.get("image", ""))
        state.set_running(self.standin_pid, host)
        state.set_ready(True)
        self.core.patch_namespaced_pod_status(meta["name"], meta["namespace"], {"status": pod_status(state, pod)})
        self.hosts[host] = (meta["namespace"], meta["labels"]["app.kubernetes.io/instance"])


class GenerationWatch(WatchThread):
    """Wall-clock times at which each LLMService's status.observedGeneration reached each value, and the
    status of each one's conditions now."""

    def __init__(self, api_client):
        self.custom = kubernetes.client.CustomObjectsApi(api_client)
        super().__init__(self.custom.list_cluster_custom_object, group=GROUP, version=VERSION, plural=PLURAL)
        self.reached: dict[tuple[str, str], dict[int, float]] = {}
        self.conditions: dict[tuple[str, str], dict[str, str]] = {}  # key -> condition type -> status

    def _on_event(self, event: dict) -> None:
        obj = event["object"]
        meta, status = obj["metadata"], obj.get("status") or {}
        key = (meta["namespace"], meta["name"])
        generation = status.get("observedGeneration")
        if generation is not None:
            self.reached.setdefault(key, {}).setdefault(generation, time.time())
        self.conditions[key] = {c.get("type"): c.get("status") for c in status.get("conditions") or ()}

    def all_true(self, keys, condition: str) -> bool:
        return all(self.conditions.get(key, {}).get(condition) == "True" for key in keys)

    def caught_up(self, key: tuple[str, str], generation: int) -> float | None:
        """When observedGeneration first reached `generation` or more, else None."""
        times = [t for g, t in self.reached.get(key, {}).items() if g >= generation]
        return min(times) if times else None


def apiserver_requests(api_client) -> Counter:
    """The apiserver's own `apiserver_request_total`, summed by (verb, resource); a WATCH counts when the
    watch is opened, so re-opened watches (a storm) show as WATCH and LIST growing."""
    config = api_client.configuration
    response = api_client.call_api("GET", config.host + "/metrics",
                                   header_params={"Authorization": config.auth_settings()["BearerToken"]["value"]})
    if response.status != 200:
        raise RuntimeError(f"apiserver /metrics: HTTP {response.status} {response.reason}")
    counts: Counter = Counter()
    for family in text_string_to_metric_families(response.read().decode()):
        for sample in family.samples:
            if sample.name == "apiserver_request_total":
                labels = sample.labels
                counts[(labels.get("verb", "?"), labels.get("resource", "") or labels.get("subresource", ""))] \
                    += sample.value
    return counts


class AuditWindow:
    """Requests in the apiserver's audit log (start_cluster's `audit_log`) between `start()` and `stop()`,
    by (user, verb, resource). A watch counts once, when it is opened (its ResponseStarted line), so a
    storm of re-opened watches shows; every other request counts at ResponseComplete."""

    def __init__(self, path):
        self.path = path
        self._start = 0

    def start(self) -> None:
        self._start = self.path.stat().st_size

    def stop(self) -> Counter:
        counts: Counter = Counter()
        with open(self.path, "rb") as log:
            log.seek(self._start)
            for line in log:
                try:
                    event = json.loads(line)
                except ValueError:
                    continue  # a line being written when the window opened
                opened = event["verb"] == "watch" and event["stage"] == "ResponseStarted"
                if opened or (event["verb"] != "watch" and event["stage"] == "ResponseComplete"):
                    ref = event.get("objectRef") or {}
                    resource = "/".join(filter(None, (ref.get("resource"), ref.get("subresource"))))
                    counts[(event["user"]["username"], event["verb"], resource or event["requestURI"])] += 1
        return counts


def memory_mib(pid: int) -> dict[str, float]:
    """Resident memory now and at its peak (VmRSS, VmHWM) of process `pid`, in MiB."""
    fields = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                fields[name] = int(value.split()[0]) / 1024
    return {"rss": fields["VmRSS"], "peak": fields["VmHWM"]}
