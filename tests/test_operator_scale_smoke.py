"""benchmarks/operator_scale.py at a small size: one operator, 10 LLMServices in 2 namespaces, on the real
apiserver, every pod answered by the metrics stand-in. What is checked is what happened (every service
reconciled its spec change and its pod got the knob live, every pod was scraped, the scrapes in flight never
exceeded the operator's bound, no watch re-opened while idle), never how fast: the figures are the
benchmark's to print."""

from __future__ import annotations

import json

import pytest

from benchmarks.operator_scale import main
from tests.kube_support import require_kube_tools

pytestmark = [pytest.mark.kube, pytest.mark.slow]

SERVICES, NAMESPACES, BOUND = 10, 2, 2


def test_small_fleet_reconciles_and_scrapes_within_the_bound(tmp_path, capsys):
    require_kube_tools()
    out = tmp_path / "scale.json"
    # scrapes slow enough (0.3 s) and ticks frequent enough (5 s) that, unbounded, they would overlap more
    assert main(["--services", str(SERVICES), "--namespaces", str(NAMESPACES), "--idle-s", "10",
                 "--tuning-interval-s", "5", "--change-interval-s", "0.2", "--scrape-delay-ms", "300",
                 "--max-concurrent-scrapes", str(BOUND), "--workdir", str(tmp_path / "run"),
                 "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert figures["reconciled"] == sorted(f"fleet-{i % NAMESPACES}/llm-{i:03d}" for i in range(SERVICES))
    assert figures["changes"] == SERVICES and figures["live_knob_seen"] == SERVICES
    scrapes = figures["scrapes"]
    assert scrapes["pods"] == SERVICES and scrapes["min_per_pod"] >= 1
    assert 1 <= scrapes["max_in_flight"] <= BOUND
    assert figures["operator_log_errors"] == 0
    idle = figures["idle_operator_per_min"]
    assert idle, "the operator made no request at all while idle: its tuners stopped"
    assert not [k for k in idle if k.startswith("watch ")], idle
    assert figures["memory_end_mib"]["rss"] > 0
    assert "reconcile p50 / p99" in capsys.readouterr().out
