"""`iterserve serve --admin-port`: /admin/* only on its own listener (one engine behind both), 404 for it
on the API port and for everything else on the admin port; SIGTERM still drains and stops both."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import pytest

from iterserve.operator.tuning.pod_admin import get_scheduler, patch_scheduler
from tests.server_support import free_port, metric_value, start_subprocess

TOKEN = "admin-secret-for-the-tests"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


def test_admin_api_only_on_the_admin_port(tiny_dir):
    admin_port = free_port()
    proc, url = start_subprocess("--model", tiny_dir, "--kv-cache-memory", "8MiB", "--threads", "1",
                                 "--max-num-seqs", "4", "--admin-port", str(admin_port),
                                 env={"ITERSERVE_ADMIN_TOKEN": TOKEN})
    admin_url = f"http://127.0.0.1:{admin_port}"
    try:
        # the API port: everything but the admin API, which looks like an unknown route
        for method in ("GET", "PATCH"):
            r = httpx.request(method, url + "/admin/scheduler", json={"max_num_seqs": 9}, headers=ADMIN)
            assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error", r.text
        assert httpx.get(url + "/v1/models").status_code == 200 and httpx.get(url + "/health").status_code == 200
        # the admin port: the admin API, still behind its token, and nothing else
        assert httpx.get(admin_url + "/admin/scheduler").status_code == 401
        for path in ("/v1/models", "/metrics", "/health", "/ready"):
            assert httpx.get(admin_url + path).status_code == 404, path
        answer = patch_scheduler(admin_url, TOKEN, {"max_num_seqs": 7})
        assert answer["changed"] == {"max_num_seqs": {"old": 4, "new": 7}}
        # one engine behind both listeners: the change shows on the API port's metrics
        assert get_scheduler(admin_url, TOKEN)["knobs"]["max_num_seqs"] == 7
        assert metric_value(httpx.get(url + "/metrics").text, "iterserve:max_num_seqs") == 7
        completion = httpx.post(url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 3}, timeout=60)
        assert completion.status_code == 200, completion.text

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(admin_url + "/admin/scheduler", headers=ADMIN)
    finally:
        if proc.poll() is None:
            proc.kill()
        out = proc.communicate()[0]
    assert "Traceback" not in out, out


@pytest.mark.parametrize("args, env, words", [
    (["--admin-port", "8000", "--port", "8000"], {"ITERSERVE_ADMIN_TOKEN": TOKEN}, "admin_port: must be in"),
    (["--admin-port", "0"], {"ITERSERVE_ADMIN_TOKEN": TOKEN}, "admin_port: must be in"),
    (["--admin-port", "8001"], {}, "admin_port: needs an admin token"),
])
def test_bad_admin_port_exits_2(tiny_dir, args, env, words):
    environment = {k: v for k, v in os.environ.items() if k != "ITERSERVE_ADMIN_TOKEN"}
    r = subprocess.run([sys.executable, "-m", "iterserve.server.entrypoints.cli", "serve", "--model", tiny_dir,
                        *args], capture_output=True, text=True, timeout=60, env={**environment, **env})
    assert r.returncode == 2 and words in r.stderr, r.stderr
