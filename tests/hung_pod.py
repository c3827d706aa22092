"""A pod that accepts connections and never answers: a Pod object of an LLMService, Ready in the API,
whose address is a local socket that reads each request and then keeps the connection open, silent.

The operator finds it as it finds any serving pod (labels, Ready, podIP, the admin-token digest), so a
resync pass or a tuner tick calling it hangs until its own timeout.
"""

from __future__ import annotations

import socket
import threading

from iterserve.operator.builders.deployment import TOKEN_DIGEST_ANNOTATION
from iterserve.operator.builders.labels import ADMIN_PORT, HTTP_PORT, labels
from iterserve.operator.builders.secret import token_digest
from iterserve.operator.kube import Kube
from tests.kubelet_standin import allocate_host


class SilentServer:
    """Listens on `host` at each port; records the first line of every request it is sent."""

    def __init__(self, host: str, ports: tuple[int, ...]):
        self.host = host
        self.requests: list[tuple[int, str]] = []  # (port, request line)
        self._connections: list[socket.socket] = []
        self._listeners = []
        self._stopped = threading.Event()
        for port in ports:
            listener = socket.create_server((host, port))
            listener.settimeout(0.2)
            self._listeners.append(listener)
            threading.Thread(target=self._accept, args=(listener, port), daemon=True).start()

    def _accept(self, listener: socket.socket, port: int) -> None:
        while not self._stopped.is_set():
            try:
                connection, _ = listener.accept()
            except (TimeoutError, OSError):
                continue
            self._connections.append(connection)
            threading.Thread(target=self._read, args=(connection, port), daemon=True).start()

    def _read(self, connection: socket.socket, port: int) -> None:
        data = b""
        try:
            while b"\r\n" not in data:
                chunk = connection.recv(4096)
                if not chunk:
                    return
                data += chunk
        except OSError:
            return
        self.requests.append((port, data.split(b"\r\n", 1)[0].decode(errors="replace")))

    def paths(self, port: int | None = None) -> list[str]:
        """The paths requested (on `port`, or on any)."""
        return [line.split()[1] for p, line in self.requests if port in (None, p) and len(line.split()) > 1]

    def close(self) -> None:
        self._stopped.set()
        for sock in self._listeners + self._connections:
            sock.close()


def create_hung_pod(kube: Kube, namespace: str, service: str, admin_token: str,
                    pod_name: str | None = None) -> SilentServer:
    """A Ready pod of LLMService `service` in the API, and the silent server at its address."""
    host = allocate_host(HTTP_PORT, ADMIN_PORT)
    server = SilentServer(host, (HTTP_PORT, ADMIN_PORT))
    name = pod_name or f"{service}-hung"
    kube.create({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": labels(service),
                     "annotations": {TOKEN_DIGEST_ANNOTATION: token_digest(admin_token)}},
        "spec": {"nodeName": "hung-node", "containers": [{
            "name": "server", "image": "silent",
            "ports": [{"name": "http", "containerPort": HTTP_PORT}, {"name": "admin", "containerPort": ADMIN_PORT}]}]},
    })
    kube.merge_patch("v1", "Pod", namespace, name, {"status": {
        "phase": "Running", "podIP": host, "conditions": [{"type": "Ready", "status": "True"}]}},
        subresource="status")
    return server
