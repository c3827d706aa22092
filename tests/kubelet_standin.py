"""Plays the kubelet (and the scheduler's binding) for the pods of a test cluster: there is no container
runtime here, so each pod's `server` container runs as a local process on its own loopback address.

For every pod (of one namespace, or all), `LocalKubelet`:
- binds it to node `local-0` through the `pods/binding` subresource when nothing has;
- builds the container's environment (the host's cache as the image's, so the pods load the kernels
  bootstrap built; literal values, ConfigMap and Secret references read through the
  API) and command line (`$(VAR)` expanded, `iterserve` -> the venv's binary, `--host` forced to a fresh
  127.0.0.N, `--port` kept, `--model` paths remapped, the test's extra args appended) and starts it;
- writes the pod's status through the status subresource: podIP, phase, containerStatuses with the
  restart count, and the Ready condition from the readiness probe, with the probe's period, timeout and
  failure threshold once the pod is Ready (before that it probes every 0.2 s);
- restarts a process that exits (restartPolicy Always), with a growing back-off, counting restarts;
- when the pod is deleted (deletionTimestamp set), runs the container's preStop exec hook as a local
  command when `prestop` is set (the product's is `sleep 5`: the time a Service takes to drop the pod), then
  SIGTERMs the process, waits out what is left of the grace period, and removes the object with
  gracePeriodSeconds=0, as a kubelet does.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx
import kubernetes

from tests.kube_processes import DaemonProcess
from tests.kube_support import KubeCluster
from tests.kubelet_podspec import (
    ContainerConfigError,
    container_argv,
    container_ports,
    decode_secret_data,
    main_container,
    readiness_target,
    resolve_env,
)
from tests.kubelet_status import PodState, container_exit_code, node_status, pod_status

_addresses = itertools.count()
_addresses_lock = threading.Lock()


def allocate_host(*ports: int) -> str:
    """A loopback address 127.0.x.y (from 127.0.0.2 on) where every one of `ports` is free to listen, so
    pods keep the ports their spec names, as pods with their own IPs do."""
    with _addresses_lock:
        for n in _addresses:
            host = f"127.0.{n // 250}.{n % 250 + 2}"
            if all(_free(host, port) for port in ports):
                return host
    raise AssertionError("unreachable")


def _free(host: str, port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
        try:
            probe.bind((host, port))
            return True
        except OSError:
            return False


class LocalKubelet:
    def __init__(self, cluster: KubeCluster, iterserve_bin: str | None = None, *, namespace: str | None = None,
                 extra_args: Sequence[str] = (), model_paths: Mapping[str, str] | None = None,
                 env: Mapping[str, str] | None = None, node_name: str = "local-0", log_dir: Path | None = None,
                 max_restart_backoff: float = 10.0, prestop: bool = False):
        self.cluster = cluster
        self.prestop = prestop  # off by default: most tests delete pods and need not wait out the hook
        self.iterserve_bin = iterserve_bin or str(Path(sys.executable).parent / "iterserve")
        self.namespace = namespace
        self.extra_args = list(extra_args)
        self.model_paths = dict(model_paths or {})
        # The image's environment, under the pod's own. The image carries the C++ kernels prebuilt
        # (ITERSERVE_CPU_KERNELS_DIR); this venv stands in for it, and its kernels are the builds bootstrap
        # left in the host's cache. The Deployment sets HOME=/tmp (the image's writable volume), which
        # would send the first pod of a fresh machine to build them all anew (3 min on 2 cores).
        self.env = {"XDG_CACHE_HOME": os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache"),
                    **(env or {})}
        self.node_name = node_name
        self.log_dir = log_dir or cluster.workdir / "pods"
        self.max_restart_backoff = max_restart_backoff
        self.client = cluster.api_client()
        self.core = kubernetes.client.CoreV1Api(self.client)
        self._runners: dict[tuple[str, str], _PodRunner] = {}
        # Kept after a pod is gone, for the test to inspect: what each pod's process did.
        self.pod_states: dict[tuple[str, str], PodState] = {}
        self.exit_codes: dict[tuple[str, str], list[int]] = {}  # every exit of each pod's process, in order
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._watcher = threading.Thread(target=self._watch_loop, name="kubelet-watch", daemon=True)

    def start(self) -> LocalKubelet:
        node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": self.node_name}}
        try:
            self.core.create_node(node)
        except kubernetes.client.ApiException as e:
            if e.status != 409:
                raise
        self.core.patch_node_status(self.node_name, {"status": node_status(self.node_name)},
                                    _content_type="application/merge-patch+json")
        self._watcher.start()
        return self

    def stop(self) -> None:
        """Stop every process this kubelet runs (the pods stay in the API, as on a node that went away)."""
        self._stopped.set()
        with self._lock:
            runners = list(self._runners.values())
        for runner in runners:
            runner.shutdown()
        for runner in runners:
            runner.join()
        self.client.close()

    def __enter__(self) -> LocalKubelet:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def restarts(self, namespace: str, name: str) -> int:
        return self.pod_states[(namespace, name)].restarts

    def pod_host(self, namespace: str, name: str) -> str | None:
        return self.pod_states[(namespace, name)].host

    def log_path(self, namespace: str, name: str) -> Path:
        return self.log_dir / f"{namespace}_{name}.log"

    def _watch_loop(self) -> None:
        resource_version = None
        while not self._stopped.is_set():
            try:
                if resource_version is None:
                    resource_version = self._relist()
                for event in kubernetes.watch.Watch().stream(
                        *self._list_call(), resource_version=resource_version, timeout_seconds=5,
                        allow_watch_bookmarks=False, deserialize=False, _request_timeout=30):
                    if self._stopped.is_set():
                        return
                    resource_version = event["object"]["metadata"]["resourceVersion"]
                    self._dispatch(event["type"], event["object"])
            except kubernetes.client.ApiException as e:
                if e.status != 410:  # 410 Gone: history compacted, relist
                    print(f"kubelet stand-in: watch failed: {e}", file=sys.stderr)
                    self._stopped.wait(0.5)
                resource_version = None
            except Exception as e:  # connection trouble: relist, as informers do
                if not self._stopped.is_set():
                    print(f"kubelet stand-in: watch failed: {e!r}", file=sys.stderr)
                self._stopped.wait(0.5)
                resource_version = None

    def _list_call(self) -> tuple:
        if self.namespace:
            return self.core.list_namespaced_pod, self.namespace
        return (self.core.list_pod_for_all_namespaces,)

    def _relist(self) -> str:
        func, *args = self._list_call()
        listing = json.loads(func(*args, _preload_content=False).data)
        seen = set()
        for pod in listing["items"]:
            seen.add((pod["metadata"]["namespace"], pod["metadata"]["name"]))
            self._dispatch("ADDED", pod)
        with self._lock:
            vanished = [runner for key, runner in self._runners.items() if key not in seen]
        for runner in vanished:
            runner.object_deleted()
        return listing["metadata"]["resourceVersion"]

    def _dispatch(self, event_type: str, pod: dict) -> None:
        if pod["spec"].get("nodeName") not in (None, "", self.node_name):
            return
        key = (pod["metadata"]["namespace"], pod["metadata"]["name"])
        with self._lock:
            runner = self._runners.get(key)
            if runner is not None and runner.uid != pod["metadata"]["uid"]:
                runner.object_deleted()  # a new pod with an old pod's name
                runner = None
            if event_type == "DELETED":
                if runner is not None:
                    runner.object_deleted()
                return
            if runner is None:
                if pod.get("status", {}).get("phase") in ("Succeeded", "Failed") or self._stopped.is_set():
                    return
                runner = self._runners[key] = _PodRunner(self, pod)
                runner.start()
            else:
                runner.update(pod)

    def _forget(self, runner: _PodRunner) -> None:
        with self._lock:
            if self._runners.get((runner.namespace, runner.name)) is runner:
                del self._runners[(runner.namespace, runner.name)]


def run_prestop(container: Mapping, grace: float) -> float:
    """Run the container's preStop exec hook here (a kubelet runs it in the container, before the SIGTERM,
    within the grace period); the seconds it took. An httpGet hook or none: nothing to run."""
    command = (((container.get("lifecycle") or {}).get("preStop") or {}).get("exec") or {}).get("command")
    if not command:
        return 0.0
    started = time.monotonic()
    try:
        subprocess.run(list(command), timeout=max(grace, 0), check=False, stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except (subprocess.TimeoutExpired, OSError):
        pass  # a hook that fails or overruns does not stop the kill, as with a kubelet
    return time.monotonic() - started


class _PodRunner(threading.Thread):
    """One pod's life on this node, on its own thread: start, probe, restart, report, stop."""

    def __init__(self, kubelet: LocalKubelet, pod: dict):
        super().__init__(name=f"pod-{pod['metadata']['name']}", daemon=True)
        self.kubelet = kubelet
        self.pod = pod
        self.namespace, self.name = pod["metadata"]["namespace"], pod["metadata"]["name"]
        self.uid = pod["metadata"]["uid"]
        self.container = main_container(pod)
        self.probe_path, self.port = readiness_target(self.container)
        probe = self.container.get("readinessProbe") or {}
        # the kubelet's defaults where the spec leaves them out
        self.failure_threshold = probe.get("failureThreshold", 3)
        self.probe_period_s = probe.get("periodSeconds", 10)
        self.probe_timeout_s = probe.get("timeoutSeconds", 1)
        self._probe_failures = 0
        self._last_probe = 0.0
        self._bound = False
        self.host: str | None = None
        self.process: DaemonProcess | None = None
        self.state = PodState(container_name=self.container["name"], image=self.container.get("image", ""))
        kubelet.pod_states[(self.namespace, self.name)] = self.state
        self._next_start = 0.0
        self._written: dict | None = None
        self._wake = threading.Event()
        self._shutdown = self._gone = False

    def update(self, pod: dict) -> None:
        self.pod = pod
        self._wake.set()

    def object_deleted(self) -> None:
        self._gone = True
        self._wake.set()

    def shutdown(self) -> None:
        self._shutdown = True
        self._wake.set()

    def run(self) -> None:
        try:
            with httpx.Client(trust_env=False, timeout=1.0) as http:
                while not (self._shutdown or self._gone or self.pod["metadata"].get("deletionTimestamp")):
                    if self.state.phase in ("Succeeded", "Failed"):
                        break
                    try:
                        self._step(http)
                    except Exception as e:  # an API hiccup must not kill the pod: try again next round
                        print(f"kubelet stand-in: pod {self.namespace}/{self.name}: {e!r}", file=sys.stderr)
                    self._wake.wait(0.5 if self.state.ready else 0.2)
                    self._wake.clear()
            self._stop_process()
            if not self._shutdown and self.pod["metadata"].get("deletionTimestamp") and not self._gone:
                self._remove_object()
        finally:
            self._stop_process()
            self.kubelet._forget(self)

    def _bind(self) -> None:
        binding = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": self.name, "namespace": self.namespace},
                   "target": {"apiVersion": "v1", "kind": "Node", "name": self.kubelet.node_name}}
        try:  # _preload_content=False: the client cannot parse the answer (a Binding without `target`)
            self.kubelet.core.create_namespaced_pod_binding(self.name, self.namespace, binding,
                                                            _preload_content=False)
        except kubernetes.client.ApiException as e:
            if e.status != 409:  # 409: already bound
                raise
        self._bound = True

    def _step(self, http) -> None:
        if not (self._bound or self.pod["spec"].get("nodeName")):
            self._bind()
        if self.process is None and time.monotonic() >= self._next_start:
            self._start_process()
        elif self.process is not None and (code := self.process.exit_code()) is not None:
            self._process_exited(code)
        self.state.set_ready(self._probe(http))
        self._write_status()

    def _probe(self, http) -> bool:
        """Ready while the probe answers 200; not ready once it failed failureThreshold times in a row,
        each a probe that did not answer within its timeoutSeconds, periodSeconds apart, as a kubelet
        does: a pod whose server answers slowly on a busy machine stays in its Service as long as it would
        under a kubelet, no shorter (a 1-s timeout every half second would take it out after two slow
        seconds). Until the first 200 it probes every round (0.2 s), sooner than a kubelet's period:
        tests need not wait out periods, and a pod counts as Ready at most 0.2 s after its server is."""
        if self.process is None:
            self._probe_failures = 0
            return False
        now = time.monotonic()
        if self.state.ready and now - self._last_probe < self.probe_period_s:
            return True
        self._last_probe = now
        try:
            answer = http.get(f"http://{self.host}:{self.port}{self.probe_path}", timeout=self.probe_timeout_s)
            if answer.status_code == 200:
                self._probe_failures = 0
                return True
            why = f"answered {answer.status_code}"
        except httpx.HTTPError as e:
            why = f"{type(e).__name__} after {time.monotonic() - now:.1f} s"
        self._probe_failures += 1
        if self.state.ready:  # a Ready pod's failures are worth a line: they take it out of its Service
            print(f"kubelet stand-in: pod {self.namespace}/{self.name}: readiness probe failed ({why}), "
                  f"{self._probe_failures} of {self.failure_threshold}", file=sys.stderr)
        return self.state.ready and self._probe_failures < self.failure_threshold

    def _start_process(self) -> None:
        self.host = self.host or allocate_host(self.port, *container_ports(self.container))
        try:
            env = resolve_env(self.pod, self.container, read_configmap=self._read_configmap,
                              read_secret=self._read_secret, pod_ip=self.host)
            argv = container_argv(self.container, env, iterserve_bin=self.kubelet.iterserve_bin, host=self.host,
                                  extra_args=self.kubelet.extra_args, model_paths=self.kubelet.model_paths)
        except ContainerConfigError as e:
            self.state.set_waiting("CreateContainerConfigError", str(e))
            self._next_start = time.monotonic() + 1.0
            return
        log_path = self.kubelet.log_path(self.namespace, self.name)
        self.process = DaemonProcess.start(f"pod {self.namespace}/{self.name}", argv, log_path,
                                           env={**os.environ, **self.kubelet.env, **env})
        self.state.set_running(self.process.pid, self.host)

    def _process_exited(self, code: int) -> None:
        self.process = None
        self.kubelet.exit_codes.setdefault((self.namespace, self.name), []).append(container_exit_code(code))
        policy = self.pod["spec"].get("restartPolicy", "Always")
        if policy == "Always" or (policy == "OnFailure" and code != 0):
            self.state.set_crashed(code)
            backoff = min(self.kubelet.max_restart_backoff, 0.5 * 2 ** self.state.restarts)
            self._next_start = time.monotonic() + backoff
        else:
            self.state.set_finished(code)

    def _stop_process(self) -> None:
        if self.process is None:
            return
        grace = self.pod["metadata"].get("deletionGracePeriodSeconds")
        if grace is None:
            grace = self.pod["spec"].get("terminationGracePeriodSeconds", 30)
        if self._shutdown:
            grace = min(grace, 10)  # the test is tearing down: do not wait out long drains
        elif self.kubelet.prestop:
            grace -= run_prestop(self.container, grace)
        code = self.process.stop(grace=max(grace, 0))
        self.kubelet.exit_codes.setdefault((self.namespace, self.name), []).append(container_exit_code(code))
        self.process = None

    def _remove_object(self) -> None:
        options = {"gracePeriodSeconds": 0, "preconditions": {"uid": self.uid}}
        try:
            self.kubelet.core.delete_namespaced_pod(self.name, self.namespace, body=options)
        except kubernetes.client.ApiException as e:
            if e.status not in (404, 409):
                raise

    def _write_status(self) -> None:
        status = pod_status(self.state, self.pod)
        if status == self._written:
            return
        try:
            self.kubelet.core.patch_namespaced_pod_status(self.name, self.namespace, {"status": status},
                                                          _content_type="application/merge-patch+json")
            self._written = status
        except kubernetes.client.ApiException as e:
            if e.status != 404:
                raise

    def _read_configmap(self, name: str) -> dict[str, str] | None:
        return self._read("read_namespaced_config_map", name, lambda obj: obj.data or {})

    def _read_secret(self, name: str) -> dict[str, str] | None:
        return self._read("read_namespaced_secret", name, lambda obj: decode_secret_data(obj.data))

    def _read(self, method: str, name: str, data_of) -> dict[str, str] | None:
        try:
            return data_of(getattr(self.kubelet.core, method)(name, self.namespace))
        except kubernetes.client.ApiException as e:
            if e.status == 404:
                return None
            raise

