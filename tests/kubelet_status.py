"""The pod status the kubelet stand-in reports: what it knows about one pod's process (`PodState`) and the
status object written through the status subresource (`pod_status`, a pure function of it)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@dataclass
class PodState:
    container_name: str
    image: str = ""
    phase: str = "Pending"
    host: str | None = None
    pid: int | None = None
    created_at: str = field(default_factory=_now)
    pod_started_at: str | None = None
    container_started_at: str | None = None
    restarts: int = 0
    ready: bool = False
    ready_changed_at: str = field(default_factory=_now)
    waiting: tuple[str, str] | None = ("ContainerCreating", "")
    last_termination: dict | None = None
    termination: dict | None = None

    def set_running(self, pid: int, host: str) -> None:
        self.phase, self.pid, self.host, self.waiting = "Running", pid, host, None
        self.container_started_at = _now()
        self.pod_started_at = self.pod_started_at or self.container_started_at

    def set_ready(self, ready: bool) -> None:
        if ready != self.ready:
            self.ready, self.ready_changed_at = ready, _now()

    def set_waiting(self, reason: str, message: str) -> None:
        self.waiting = (reason, message)

    def set_crashed(self, exit_code: int) -> None:
        """The process exited and will be started again: one more restart."""
        self.last_termination = self._terminated(exit_code)
        self.restarts += 1
        self.pid, self.waiting = None, ("CrashLoopBackOff", f"exited with {exit_code}; restarting")
        self.set_ready(False)

    def set_finished(self, exit_code: int) -> None:
        """The process exited for good (restartPolicy Never, or OnFailure after a success)."""
        self.termination = self._terminated(exit_code)
        self.phase, self.pid, self.waiting = ("Succeeded" if exit_code == 0 else "Failed"), None, None
        self.set_ready(False)

    def _terminated(self, exit_code: int) -> dict:
        reason = "Completed" if exit_code == 0 else "Error"
        return {"exitCode": container_exit_code(exit_code), "reason": reason,
                "startedAt": self.container_started_at, "finishedAt": _now()}


def container_exit_code(returncode: int) -> int:
    """A process killed by signal N (Popen's -N) exits 128 + N, as in a container."""
    return 128 - returncode if returncode < 0 else returncode


def _container_state(state: PodState) -> dict:
    if state.termination is not None:
        return {"terminated": state.termination}
    if state.waiting is not None:
        reason, message = state.waiting
        return {"waiting": {"reason": reason, **({"message": message} if message else {})}}
    return {"running": {"startedAt": state.container_started_at}}


def pod_status(state: PodState, pod: dict) -> dict:
    """The whole `status` of the pod (written with a merge patch, so lists are replaced, not merged)."""
    ready = "True" if state.ready else "False"
    scheduled_at = state.created_at
    container = {
        "name": state.container_name, "image": state.image, "imageID": "", "ready": state.ready,
        "restartCount": state.restarts, "started": state.pid is not None, "state": _container_state(state),
        "lastState": {"terminated": state.last_termination} if state.last_termination else {},
    }
    if state.pid is not None:
        container["containerID"] = f"local://{state.pid}"
    status = {
        "phase": state.phase,
        "hostIP": "127.0.0.1",
        "conditions": [
            {"type": "Initialized", "status": "True", "lastTransitionTime": scheduled_at},
            {"type": "Ready", "status": ready, "lastTransitionTime": state.ready_changed_at},
            {"type": "ContainersReady", "status": ready, "lastTransitionTime": state.ready_changed_at},
            {"type": "PodScheduled", "status": "True", "lastTransitionTime": scheduled_at},
        ],
        "containerStatuses": [container],
    }
    if state.host is not None:
        status["podIP"], status["podIPs"] = state.host, [{"ip": state.host}]
    if state.pod_started_at is not None:
        status["startTime"] = state.pod_started_at
    if pod.get("status", {}).get("qosClass"):
        status["qosClass"] = pod["status"]["qosClass"]
    return status


def node_status(node_name: str) -> dict:
    """A Ready node on loopback (no node controller runs to mark it otherwise)."""
    now = _now()
    return {
        "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "kubelet stand-in",
                        "lastHeartbeatTime": now, "lastTransitionTime": now}],
        "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}, {"type": "Hostname", "address": node_name}],
    }
