"""The DNS stand-in's hosts file: a name's marked lines follow the endpoints, other lines stay."""

from __future__ import annotations

import pytest

from tests.dns_standin import MARK, HostsDns, with_records
from tests.waiting import wait_until

BASE = "127.0.0.1 localhost\n::1 localhost ip6-localhost\n"


@pytest.mark.parametrize("text, name, addresses, want", [
    (BASE, "a-pods.live.svc", ["127.0.0.5", "127.0.0.6"],
     BASE + f"127.0.0.5 a-pods.live.svc {MARK} a-pods.live.svc\n127.0.0.6 a-pods.live.svc {MARK} a-pods.live.svc\n"),
    (BASE + f"127.0.0.5 a-pods.live.svc {MARK} a-pods.live.svc\n", "a-pods.live.svc", ["127.0.0.7"],
     BASE + f"127.0.0.7 a-pods.live.svc {MARK} a-pods.live.svc\n"),
    (BASE + f"127.0.0.5 a-pods.live.svc {MARK} a-pods.live.svc\n", "a-pods.live.svc", [], BASE),
    # another name's lines, and a line a person wrote for the same name, are not this name's to change
    (BASE + f"127.0.0.9 b {MARK} b\n10.0.0.1 a-pods.live.svc\n", "a-pods.live.svc", ["127.0.0.5"],
     BASE + f"127.0.0.9 b {MARK} b\n10.0.0.1 a-pods.live.svc\n127.0.0.5 a-pods.live.svc {MARK} a-pods.live.svc\n"),
])
def test_with_records(text, name, addresses, want):
    assert with_records(text, name, addresses) == want


class Endpoints:
    def __init__(self, urls):
        self.urls = urls

    def endpoints(self):
        return list(self.urls)


def test_the_lines_follow_the_endpoints_and_leave_with_stop(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text(BASE)
    service = Endpoints(["http://127.0.0.6:8000", "http://127.0.0.5:8000"])
    dns = HostsDns(service, "x", path=hosts, interval=0.05).start()
    assert hosts.read_text() == with_records(BASE, "x", ["127.0.0.5", "127.0.0.6"])
    service.urls = ["http://127.0.0.6:8000"]
    wait_until(lambda: hosts.read_text() == with_records(BASE, "x", ["127.0.0.6"]), timeout=10,
               what="the gone pod's line removed")
    dns.stop()
    assert hosts.read_text() == BASE
