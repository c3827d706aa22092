"""benchmarks/router_fleet.py end to end at tiny sizes: two real servers, the real router with each policy,
a seeded open-loop load through it. Its figures depend on the machine; what must hold in any run is that
no request fails, every policy and workload is reported, and round-robin splits the requests evenly."""

from __future__ import annotations

import json

import pytest

from benchmarks.router_fleet import POLICIES, main

pytestmark = pytest.mark.slow


def test_every_policy_runs_through_the_router_without_a_failure(tmp_path, capsys):
    out = tmp_path / "fleet.json"
    assert main(["--requests", "4", "--rate", "8", "--rounds", "1", "--workloads", "mixed,system-prompt",
                 "--output-len", "4", "--max-model-len", "512", "--prefix-len", "64", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"mixed", "system-prompt"}
    for workload, result in results.items():
        assert set(result["runs"]) == set(POLICIES)
        for policy, (run,) in result["runs"].items():
            assert run["summary"]["num_failed"] == 0, (workload, policy)
            assert run["summary"]["num_completed"] == 4, (workload, policy)
            # the 4 requests, the bench's model list and its probe all went through the router to a pod
            assert sum(run["per_pod"]) >= 4, (workload, policy)
            assert f"{workload} round 1  {policy}" in printed
        a, b = result["runs"]["round-robin"][0]["per_pod"]
        assert abs(a - b) <= 1  # blind to load: each pod in turn
        assert "RR p99 / p99" in printed
