"""A real Prometheus (Debian's `prometheus` package) for tests: started on a free loopback port with a
temporary config that scrapes the given targets every second, and stopped again.

`PROMETHEUS_BIN` overrides the binary (default: `prometheus` on PATH, else /usr/bin/prometheus); the
fixture skips with the reason when there is none, and FAILS instead when ITERSERVE_REQUIRE_PROMETHEUS=1.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import yaml

from tests.server_support import answers, exited, free_port
from tests.waiting import wait_until


def prometheus_binary() -> str | None:
    explicit = os.environ.get("PROMETHEUS_BIN")
    if explicit:
        return explicit
    found = shutil.which("prometheus")
    if found:
        return found
    return "/usr/bin/prometheus" if os.access("/usr/bin/prometheus", os.X_OK) else None


def require_prometheus() -> str:
    binary = prometheus_binary()
    if binary is None:
        reason = "no prometheus binary (apt-get install prometheus, or set PROMETHEUS_BIN)"
        # `bootstrap.sh --with-kube` installs prometheus with etcd, so the CI's ITERSERVE_REQUIRE_KUBE=1
        # makes a missing one a failure too, not a silent skip
        if "1" in (os.environ.get("ITERSERVE_REQUIRE_PROMETHEUS"), os.environ.get("ITERSERVE_REQUIRE_KUBE")):
            pytest.fail(reason)
        pytest.skip(reason)
    return binary


@dataclass
class PrometheusServer:
    url: str
    proc: subprocess.Popen
    workdir: Path

    def query(self, promql: str, at: float | None = None) -> list[dict]:
        params = {"query": promql} if at is None else {"query": promql, "time": f"{at:.3f}"}
        body = httpx.get(f"{self.url}/api/v1/query", params=params, timeout=10).json()
        assert body["status"] == "success", body
        return body["data"]["result"]

    def wait_for_targets(self, num_targets: int, timeout: float = 30.0) -> None:
        """Until every target has been scraped at least once and is up."""
        wait_until(lambda: len(self.query("up == 1")) >= num_targets, timeout=timeout, interval=0.25,
                   what=f"{num_targets} targets of prometheus at {self.url} to be up")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def start_prometheus(workdir: Path, targets: list[str], *, labels: dict[str, str] | None = None,
                     scrape_interval: str = "1s", binary: str | None = None) -> PrometheusServer:
    """Scrape `targets` (base URLs like http://127.0.0.1:PORT) at `scrape_interval`, each series labelled
    with `labels` (e.g. {"service": "chat"}) besides Prometheus' own `instance` and `job`."""
    binary = binary or require_prometheus()
    workdir.mkdir(parents=True, exist_ok=True)
    config = {
        "global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval},
        "scrape_configs": [{
            "job_name": "iterserve",
            "scrape_timeout": scrape_interval,
            "static_configs": [{"targets": [urlsplit(t).netloc for t in targets], "labels": labels or {}}],
        }],
    }
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = open(workdir / "prometheus.log", "w")
    proc = subprocess.Popen(
        [binary, f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=log, stderr=subprocess.STDOUT)
    server = PrometheusServer(f"http://127.0.0.1:{port}", proc, workdir)
    try:
        wait_until(lambda: answers(f"{server.url}/-/ready"), timeout=30, interval=0.1, what="prometheus to be ready",
                   fail_if=exited(proc))
    except (RuntimeError, TimeoutError) as e:
        server.stop()
        raise RuntimeError(f"{e}; its log: {(workdir / 'prometheus.log').read_text()}") from None
    return server
