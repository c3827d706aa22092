"""e2e/ fixtures: the operator installed from manifests/ (once), a fresh namespace per test.

Without ITERSERVE_E2E_KUBECONFIG (or with a cluster that does not answer) every test is skipped, saying
why, or fails with ITERSERVE_REQUIRE_E2E=1 (CI); with one, nothing is skipped."""

from __future__ import annotations

import os
import secrets

import pytest

from e2e.support import (
    OPERATOR_NS,
    READY_TIMEOUT,
    ROOT,
    condition,
    get,
    install_client_script,
    kubectl,
    pods,
    skip_reason,
    wait_until,
)

REASON = skip_reason()


def pytest_collection_modifyitems(config, items):
    if REASON and os.environ.get("ITERSERVE_REQUIRE_E2E") == "1":
        raise pytest.UsageError(f"ITERSERVE_REQUIRE_E2E=1 but {REASON}")
    if REASON:
        for item in items:
            item.add_marker(pytest.mark.skip(reason=REASON))


@pytest.fixture(scope="session")
def operator_installed():
    """manifests/ applied as a user would (kubectl apply -k), and both operator replicas Ready."""
    kubectl("apply", "-k", str(ROOT / "manifests"))

    def both_ready():
        replicas = [p for p in pods(OPERATOR_NS, "app.kubernetes.io/name=iterserve-operator")
                    if not p["metadata"].get("deletionTimestamp")]
        return len(replicas) == 2 and all(condition(p, "Ready").get("status") == "True" for p in replicas)

    wait_until(both_ready, "both operator replicas Ready", timeout=READY_TIMEOUT)
    wait_until(lambda: (get("lease", "iterserve-operator", OPERATOR_NS) or {}).get("spec", {}).get("holderIdentity"),
               "an operator replica to take the Lease", timeout=READY_TIMEOUT)


@pytest.fixture
def namespace(operator_installed):
    ns = f"iterserve-e2e-{secrets.token_hex(3)}"
    kubectl("create", "namespace", ns)
    install_client_script(ns)
    yield ns
    kubectl("delete", "namespace", ns, "--wait=false", check=False)
