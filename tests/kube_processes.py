"""Long-running child processes of the test harness (etcd, kube-apiserver, servers the kubelet stand-in
runs): each logs to a file, dies with the test process, and is stopped by `stop_all` at interpreter exit."""

from __future__ import annotations

import ctypes
import signal
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

_PR_SET_PDEATHSIG = 1
_live: set[DaemonProcess] = set()
_live_lock = threading.Lock()


def _die_with_parent() -> None:
    # Even a SIGKILLed pytest must not leave an API server or model server behind on a shared box.
    # The kernel sends this when the *thread* that forked exits: callers start processes from threads
    # that outlive them (the main thread, or a pod's runner thread that waits for its process).
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


@dataclass(eq=False)
class DaemonProcess:
    name: str
    popen: subprocess.Popen
    log_path: Path

    @classmethod
    def start(cls, name: str, argv: list[str], log_path: Path, *, env: dict | None = None,
              cwd: Path | None = None) -> DaemonProcess:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            popen = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, cwd=cwd, preexec_fn=_die_with_parent)
        process = cls(name, popen, log_path)
        with _live_lock:
            _live.add(process)
        return process

    @property
    def pid(self) -> int:
        return self.popen.pid

    def exit_code(self) -> int | None:
        return self.popen.poll()

    def check_running(self) -> None:
        if (code := self.popen.poll()) is not None:
            raise RuntimeError(f"{self.name} exited with {code}; log {self.log_path}:\n{self.log_tail()}")

    def terminate(self) -> None:
        """SIGTERM, once; `wait` or `stop` finish the job."""
        if self.popen.poll() is None:
            self.popen.terminate()

    def wait(self, timeout: float) -> int | None:
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, grace: float = 10.0) -> int:
        """SIGTERM, then SIGKILL after `grace` seconds; returns the exit code."""
        self.terminate()
        if self.wait(grace) is None:
            self.popen.kill()
            self.popen.wait()
        with _live_lock:
            _live.discard(self)
        return self.popen.returncode

    def log_tail(self, num_lines: int = 40) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()[-num_lines:]
        except OSError:
            lines = []
        return f"--- {self.name} ({self.log_path}), last {len(lines)} lines:\n" + "\n".join(lines)


def stop_all() -> None:
    with _live_lock:
        processes = list(_live)
    for process in processes:
        process.stop(grace=5.0)
