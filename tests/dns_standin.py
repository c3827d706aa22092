"""A headless Service's DNS answer for a client on this machine (no cluster DNS here): the addresses of a
`ServiceStandin`'s endpoints, written as /etc/hosts lines under one name and kept to them, as the
Service's A records follow its ready pods. glibc reads /etc/hosts at each lookup and answers with every
line of a name (host.conf `multi on`), so `iterserve router --dns-name NAME` sees pods come and go as it
would in a cluster. Each line carries a marker comment; `stop()` removes this name's lines."""

from __future__ import annotations

import threading
import urllib.parse
from pathlib import Path

from tests.service_standin import ServiceStandin

MARK = "# iterserve dns stand-in for"
HOSTS = Path("/etc/hosts")


def with_records(text: str, name: str, addresses: list[str]) -> str:
    """`text` (a hosts file) with `name`'s marked lines replaced by one line per address; others kept."""
    tag = f"{MARK} {name}"
    kept = [line for line in text.splitlines() if not line.endswith(tag)]
    return "\n".join([*kept, *(f"{a} {name} {tag}" for a in addresses)]) + "\n"


class HostsDns(threading.Thread):
    """Keeps `name`'s /etc/hosts lines to the Service stand-in's endpoints, checked every `interval` s."""

    def __init__(self, service: ServiceStandin, name: str, path: Path = HOSTS, interval: float = 0.5):
        super().__init__(name=f"dns-{name}", daemon=True)
        self.service, self.dns_name, self.path, self.interval = service, name, path, interval
        self.stopped = threading.Event()
        self._written: list[str] | None = None

    def addresses(self) -> list[str]:
        return sorted(urllib.parse.urlsplit(u).hostname or "" for u in self.service.endpoints())

    def write(self, addresses: list[str]) -> None:
        # one write in place (a container's /etc/hosts is a bind mount: no rename over it); a lookup that
        # reads it half-written fails, and the router keeps the pods it knows
        self.path.write_text(with_records(self.path.read_text(), self.dns_name, addresses))
        self._written = addresses

    def start(self) -> HostsDns:  # type: ignore[override]  # returns self, for `dns = HostsDns(...).start()`
        self.write(self.addresses())
        super().start()
        return self

    def run(self) -> None:
        while not self.stopped.wait(self.interval):
            addresses = self.addresses()
            if addresses != self._written:
                self.write(addresses)

    def stop(self) -> None:
        self.stopped.set()
        self.join(timeout=10)
        self.write([])
