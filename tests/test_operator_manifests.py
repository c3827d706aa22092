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
import tomllib

from iterserve.operator.builders.deployment import RUN_AS
from iterserve.operator.builders.networkpolicy import NAMESPACE_NAME_LABEL
from iterserve.operator.builders.secret import ADMIN_SECRET
from iterserve.operator.constants import DEFAULT_OPERATOR_LABELS, DEFAULT_OPERATOR_NAMESPACE, KIND
from tests.operator_support import rendered_manifests, schema_errors

ROOT = Path(__file__).resolve().parents[1]
VERSIONS = ("1.25", kubernetes_validate.latest_version())


@pytest.fixture(scope="module")
def rendered() -> list[dict]:
    return rendered_manifests()


@pytest.fixture(scope="module")
def namespaced() -> list[dict]:
    return rendered_manifests("manifests/namespaced")


def only(docs: list[dict], kind: str, name: str) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def container_of(docs: list[dict]) -> dict:
    (container,) = only(docs, "Deployment", "iterserve-operator")["spec"]["template"]["spec"]["containers"]
    return container


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


def test_namespaced_mode_has_roles_and_no_cluster_rights(namespaced, rendered):
    kinds = sorted(doc["kind"] for doc in namespaced)
    assert kinds == sorted(["Namespace", "CustomResourceDefinition", "ServiceAccount", "Role", "Role",
                            "RoleBinding", "RoleBinding", "Deployment", "ConfigMap"])
    for doc in namespaced:
        kubernetes_validate.validate(doc, VERSIONS[-1], strict=True)
    role = only(namespaced, "Role", "iterserve-operator")
    binding = only(namespaced, "RoleBinding", "iterserve-operator")
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == "team-a"
    assert binding["roleRef"]["name"] == "iterserve-operator" and binding["roleRef"]["kind"] == "Role"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "iterserve-operator",
                                    "namespace": "iterserve-system"}]
    # the same rights as cluster-wide, in one namespace; kopf follows CRDs only cluster-wide
    cluster_rules = only(rendered, "ClusterRole", "iterserve-operator")["rules"]
    assert role["rules"] == [r for r in cluster_rules if r["apiGroups"] != ["apiextensions.k8s.io"]]
    args = container_of(namespaced)["args"]
    assert "--namespace=team-a" in args and "--all-namespaces" not in args
    assert not any(a.startswith("--namespace") for a in container_of(rendered)["args"])  # all namespaces


@pytest.mark.parametrize("mode", ["manifests", "manifests/namespaced"])
def test_secret_rights_are_create_and_the_admin_tokens_alone(mode):
    (rules,) = [d["rules"] for d in rendered_manifests(mode) if d["kind"] in ("ClusterRole", "Role")
                and d["metadata"]["name"] == "iterserve-operator"]
    secret_rules = [r for r in rules if "secrets" in r["resources"]]
    assert all(r["resources"] == ["secrets"] for r in secret_rules)
    unnamed = {verb for r in secret_rules if "resourceNames" not in r for verb in r["verbs"]}
    named = {verb for r in secret_rules if r.get("resourceNames") == [ADMIN_SECRET] for verb in r["verbs"]}
    assert unnamed == {"create"}  # resourceNames cannot restrict create: nothing that reads
    assert named == {"get", "patch"} and len(secret_rules) == 2


def test_operator_pods_match_what_the_network_policies_admit(rendered):
    """Each LLMService's NetworkPolicy opens the admin port to the operator's namespace (by its name
    label) and pod labels, as the operator's flags default to them."""
    namespace = only(rendered, "Namespace", DEFAULT_OPERATOR_NAMESPACE)
    assert namespace["metadata"]["labels"][NAMESPACE_NAME_LABEL] == DEFAULT_OPERATOR_NAMESPACE
    deployment = only(rendered, "Deployment", "iterserve-operator")
    assert deployment["metadata"]["namespace"] == DEFAULT_OPERATOR_NAMESPACE
    assert DEFAULT_OPERATOR_LABELS.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()


def test_operator_has_probes_and_resources(rendered):
    container = container_of(rendered)
    args = container["args"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["health"] == int(args[args.index("--health-port") + 1])
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "health"}, probe
    assert container["resources"]["requests"].keys() == {"cpu", "memory"}
    assert "memory" in container["resources"]["limits"]


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
    dashboard = json.loads((ROOT / "manifests/base/grafana-dashboard.json").read_text())
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


def test_images_copy_every_source_folder_the_package_maps():
    folders = set(re.findall(r'"iterserve(?:\.\w+)?" = "(\w+)"', (ROOT / "pyproject.toml").read_text()))
    assert {"iterserve", "server", "operator", "kernels", "common"} <= folders
    for name in ("Dockerfile.server", "Dockerfile.operator"):
        text = (ROOT / "manifests" / name).read_text()
        assert not [f for f in folders if f"COPY {f} {f}" not in text], name


# module imported -> the PyPI distribution that provides it
DISTRIBUTIONS = {"kopf": "kopf", "kubernetes": "kubernetes", "httpx": "httpx", "prometheus_client": "prometheus-client"}


def test_operator_image_installs_the_operator_extra_with_everything_operator_code_imports():
    imported = set()
    for path in (ROOT / "operator").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
    third_party = {m for m in imported if m not in sys.stdlib_module_names and m not in ("iterserve", "__future__")}
    assert not third_party - DISTRIBUTIONS.keys(), f"map these imports to their distributions: {third_party}"
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["operator"]
    for module in third_party:
        assert any(r.startswith(DISTRIBUTIONS[module] + ">=") for r in extra), f"the operator extra lacks {module}"
    dockerfile = (ROOT / "manifests/Dockerfile.operator").read_text()
    assert 'pip install $PIP_INSTALL_OPTIONS ".[operator]"' in dockerfile and "--no-deps" not in dockerfile
