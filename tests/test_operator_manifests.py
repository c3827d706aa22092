"""manifests/: `kubectl kustomize` renders offline into valid objects; the samples, the Grafana dashboard
and the Dockerfiles agree with the code (metric names, the unprivileged user, the operator's imports)."""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

import kubernetes_validate
import pytest

from iterserve.operator.builders.deployment import RUN_AS
from iterserve.operator.constants import KIND
from tests.operator_support import rendered_manifests, schema_errors

ROOT = Path(__file__).resolve().parents[1]
VERSIONS = ("1.25", kubernetes_validate.latest_version())


@pytest.fixture(scope="module")
def rendered() -> list[dict]:
    return rendered_manifests()


def test_manifests_render_to_valid_objects(rendered):
    kinds = sorted(doc["kind"] for doc in rendered)
    assert kinds == sorted(["Namespace", "CustomResourceDefinition", "ServiceAccount", "ClusterRole",
                            "ClusterRoleBinding", "Role", "RoleBinding", "Deployment", "ConfigMap"])
    for doc in rendered:
        for version in VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{doc['kind']} {doc['metadata']['name']} on {version}: {str(e).splitlines()[0]}")


def test_operator_deployment_runs_unprivileged_as_its_service_account(rendered):
    (deployment,) = [d for d in rendered if d["kind"] == "Deployment"]
    (account,) = [d for d in rendered if d["kind"] == "ServiceAccount"]
    pod = deployment["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == account["metadata"]["name"] == "iterserve-operator"
    assert deployment["spec"]["replicas"] == 2  # safe: one leader (operator/leader.py)
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] == RUN_AS
    (container,) = pod["containers"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert {e["name"] for e in container["env"]} >= {"POD_NAME", "POD_NAMESPACE"}
    bindings = [d for d in rendered if d["kind"] in ("ClusterRoleBinding", "RoleBinding")]
    assert all(b["subjects"] == [{"kind": "ServiceAccount", "name": "iterserve-operator",
                                  "namespace": "iterserve-system"}] for b in bindings)


def test_samples_render_and_validate():
    docs = rendered_manifests("manifests/samples")
    services = [d for d in docs if d["kind"] == KIND]
    assert len(services) >= 2
    for doc in services:
        assert schema_errors(doc) == [], doc["metadata"]["name"]
    for doc in docs:
        if doc["kind"] != KIND:
            kubernetes_validate.validate(doc, VERSIONS[-1], strict=True)


def test_dashboard_queries_only_documented_metrics():
    dashboard = json.loads((ROOT / "manifests/grafana-dashboard.json").read_text())
    documented = set(re.findall(r"`((?:vllm|iterserve):[a-z_]+)", (ROOT / "docs/metrics.md").read_text()))
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    assert len(exprs) >= 10
    for expr in exprs:
        for metric in re.findall(r"(?:vllm|iterserve):[a-z_]+", expr):
            assert metric in documented or metric.removesuffix("_bucket") in documented, (metric, expr)
    assert {p["gridPos"]["y"] for p in dashboard["panels"]}  # laid out, not stacked at one spot


def test_images_run_as_the_user_the_pods_expect():
    for name in ("Dockerfile.server", "Dockerfile.operator"):
        text = (ROOT / "manifests" / name).read_text()
        assert f"USER {RUN_AS}:{RUN_AS}" in text and f"--uid {RUN_AS}" in text, name
    assert 'CMD ["iterserve", "serve"]' in (ROOT / "manifests/Dockerfile.server").read_text()


# module imported -> the PyPI distribution that provides it
DISTRIBUTIONS = {"kopf": "kopf", "kubernetes": "kubernetes", "httpx": "httpx", "prometheus_client": "prometheus-client",
                 "yaml": "pyyaml"}


def test_operator_image_installs_everything_operator_code_imports():
    imported = set()
    for path in (ROOT / "operator").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
    third_party = {m for m in imported if m not in sys.stdlib_module_names and m not in ("iterserve", "__future__")}
    assert not third_party - DISTRIBUTIONS.keys(), f"map these imports to their distributions: {third_party}"
    dockerfile = (ROOT / "manifests/Dockerfile.operator").read_text()
    for module in third_party:
        assert f'"{DISTRIBUTIONS[module]}' in dockerfile, f"Dockerfile.operator does not install {module}"
