"""Plays a Service (the endpoints controller and kube-proxy) for a client on this machine, over the pods
that tests/kubelet_standin.py runs: there is no kube-proxy here, so the client asks this object where
each request goes.

`ServiceStandin` watches the pods of one label selector through the API server. Its endpoints are the
pods that are Ready, not terminating and carry `endpoint_labels` (the rest of the Service's selector: the
operator's rotation label, which it changes on running pods). A deleted pod leaves them at once, as the
endpoints controller drops a pod with a deletionTimestamp (its preStop hook keeps it serving meanwhile),
and `next_url()` hands them out in turn (kube-proxy's IPVS round-robin; its iptables mode picks at
random, the same share on average). It also keeps the fleet's timeline, every change of the pods that
exist (bound, starting, serving or draining) and of the endpoints, from which `pod_seconds` counts what a
run spent.
"""

from __future__ import annotations

import itertools
import threading
import time

import kubernetes

WATCH_SECONDS = 60  # each watch call's server-side timeout; the loop re-opens it


class NoEndpoints(RuntimeError):
    pass


def is_endpoint(pod: dict, endpoint_labels: dict[str, str] | None = None) -> bool:
    """Ready, with an address, not terminating and selected: what a Service's ready endpoints hold."""
    if pod["metadata"].get("deletionTimestamp") or not (pod.get("status") or {}).get("podIP"):
        return False
    labels = pod["metadata"].get("labels") or {}
    if any(labels.get(key) != value for key, value in (endpoint_labels or {}).items()):
        return False
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


class ServiceStandin:
    def __init__(self, api_client, namespace: str, selector: str, port: int = 8000, clock=time.perf_counter,
                 endpoint_labels: dict[str, str] | None = None):
        self.core = kubernetes.client.CoreV1Api(api_client)
        self.namespace, self.selector, self.port = namespace, selector, port
        self.endpoint_labels = endpoint_labels
        self.clock = clock
        self._pods: dict[str, dict] = {}
        self._turn = itertools.count()
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._listed = threading.Event()
        # (time, pods that exist, endpoints), one entry per change, oldest first
        self.timeline: list[tuple[float, int, int]] = []
        self._thread = threading.Thread(target=self._watch_loop, name="service-standin", daemon=True)

    def start(self) -> ServiceStandin:
        self._thread.start()
        if not self._listed.wait(60):
            raise RuntimeError(f"no pod list of {self.namespace}/{self.selector} in 60 s")
        return self

    def stop(self) -> None:
        """Stop following the pods. The watch thread (a daemon) ends at its next event or when the server
        closes the watch; nobody waits for that."""
        self._stopped.set()

    def __enter__(self) -> ServiceStandin:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def endpoints(self) -> list[str]:
        with self._lock:
            return sorted(f"http://{p['status']['podIP']}:{self.port}" for p in self._pods.values()
                          if is_endpoint(p, self.endpoint_labels))

    def next_url(self) -> str:
        urls = self.endpoints()
        if not urls:
            raise NoEndpoints(f"no ready endpoint for {self.namespace}/{self.selector}")
        return urls[next(self._turn) % len(urls)]

    def pods(self) -> int:
        with self._lock:
            return len(self._pods)

    def pod_seconds(self, start: float, end: float) -> float:
        """Pods that existed, integrated over [start, end] (the timeline's clock): what the fleet cost."""
        with self._lock:
            timeline = list(self.timeline)
        return pod_seconds(timeline, start, end)

    def _watch_loop(self) -> None:
        version = None
        while not self._stopped.is_set():
            try:
                if version is None:
                    listed = self.core.list_namespaced_pod(self.namespace, label_selector=self.selector)
                    with self._lock:
                        self._pods = {p.metadata.name: self.core.api_client.sanitize_for_serialization(p)
                                      for p in listed.items}
                        self._record()
                    version = listed.metadata.resource_version
                    self._listed.set()
                stream = kubernetes.watch.Watch().stream(
                    self.core.list_namespaced_pod, self.namespace, label_selector=self.selector,
                    resource_version=version, timeout_seconds=WATCH_SECONDS, _request_timeout=WATCH_SECONDS + 10)
                for event in stream:
                    pod = self.core.api_client.sanitize_for_serialization(event["object"])
                    version = pod["metadata"].get("resourceVersion", version)
                    with self._lock:
                        if event["type"] == "DELETED":
                            self._pods.pop(pod["metadata"]["name"], None)
                        elif event["type"] in ("ADDED", "MODIFIED"):
                            self._pods[pod["metadata"]["name"]] = pod
                        self._record()
                    if self._stopped.is_set():
                        return
            except kubernetes.client.ApiException as e:
                version = None if e.status == 410 else version  # expired: list again
                self._stopped.wait(0.5)
            except Exception:  # a dropped connection: resume from the last version seen
                self._stopped.wait(0.5)

    def _record(self) -> None:
        entry = (len(self._pods), sum(is_endpoint(p, self.endpoint_labels) for p in self._pods.values()))
        if not self.timeline or self.timeline[-1][1:] != entry:
            self.timeline.append((self.clock(), *entry))


def pod_seconds(timeline: list[tuple[float, int, int]], start: float, end: float) -> float:
    """The step function `timeline` ((time, pods, endpoints) at each change) integrated over [start, end]."""
    total, pods, t = 0.0, 0, start
    for at, n, _ in timeline:
        if at > start:
            total += pods * (min(at, end) - t)
            t = min(at, end)
        if at >= end:
            return total
        pods = n
    return total + pods * (end - t)
