"""The LLMService CRD: a valid, structural apiextensions/v1 object whose schema accepts the samples,
rejects bad specs at the field, and defaults exactly as the operator does."""

from __future__ import annotations

import copy
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from iterserve.operator.constants import GROUP, KIND, PLURAL, SHORT_NAME, VERSION
from iterserve.operator.spec import parse_llmservice
from tests.operator_support import CRD, SCHEMA, schema_errors

ROOT = Path(__file__).resolve().parents[1]
(CRD_VERSION,) = CRD["spec"]["versions"]


def samples() -> list[dict]:
    docs = []
    for path in sorted((ROOT / "manifests/samples").glob("*.yaml")):
        if path.name != "kustomization.yaml":
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d and d["kind"] == KIND]
    return docs


def test_crd_is_a_valid_object_with_the_documented_names():
    kubernetes_validate.validate(CRD, kubernetes_validate.latest_version(), strict=True)
    assert CRD["metadata"]["name"] == f"{PLURAL}.{GROUP}"
    names = CRD["spec"]["names"]
    assert (names["kind"], names["plural"], names["shortNames"]) == (KIND, PLURAL, [SHORT_NAME])
    assert CRD["spec"]["scope"] == "Namespaced" and CRD_VERSION["name"] == VERSION
    assert CRD_VERSION["subresources"]["status"] == {}
    assert CRD_VERSION["subresources"]["scale"] == {"specReplicasPath": ".spec.replicas",
                                                     "statusReplicasPath": ".status.replicas",
                                                     "labelSelectorPath": ".status.selector"}


def _structural_problems(node: dict, path: str) -> list[str]:
    """The rules of a structural schema the API server enforces (a type everywhere, no type inside anyOf)."""
    problems = []
    if "type" not in node and not node.get("x-kubernetes-int-or-string") and \
            not node.get("x-kubernetes-preserve-unknown-fields"):
        problems.append(f"{path}: no type")
    for branch in node.get("anyOf", []) + node.get("oneOf", []):
        if node.get("x-kubernetes-int-or-string") and branch in ({"type": "integer"}, {"type": "string"}):
            continue
        problems.append(f"{path}: anyOf/oneOf branch {branch} is not allowed here")
    for name, child in (node.get("properties") or {}).items():
        problems += _structural_problems(child, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        problems += _structural_problems(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        problems += _structural_problems(node["additionalProperties"], f"{path}{{}}")
    return problems


def test_schema_is_structural():
    assert _structural_problems(SCHEMA, "") == []


def test_printer_columns_show_readiness_knobs_and_p99s():
    columns = {c["name"]: c["jsonPath"] for c in CRD_VERSION["additionalPrinterColumns"]}
    assert columns["Ready"] == ".status.readyReplicas"
    assert columns["Desired"] == ".status.desiredReplicas"
    assert columns["Max-Seqs"] == ".status.knobs.maxNumSeqs"
    assert columns["Chunk"] == ".status.knobs.prefillChunkSize"
    assert columns["TTFT-P99-ms"] == ".status.ttftP99Ms" and columns["ITL-P99-ms"] == ".status.itlP99Ms"
    assert columns["Tuned"] == '.status.conditions[?(@.type=="Tuned")].status'


def test_samples_validate_against_the_schema_and_the_operator():
    docs = samples()
    assert len(docs) >= 2
    for doc in docs:
        assert schema_errors(doc) == [], doc["metadata"]["name"]
        parse_llmservice({**doc, "metadata": {**doc["metadata"], "namespace": "default", "uid": "u"}})


def sample(**spec_changes) -> dict:
    doc = copy.deepcopy(samples()[0])
    doc["spec"].update(spec_changes)
    return doc


@pytest.mark.parametrize("changes, field", [
    ({"replicas": -1}, "spec.replicas"),
    ({"replicas": "two"}, "spec.replicas"),
    ({"model": {"source": "s3"}}, "spec.model.source"),
    ({"model": {"path": "/x"}}, "spec.model"),  # source is required
    ({"engine": {"maxNumSeqs": 0}}, "spec.engine.maxNumSeqs"),
    ({"engine": {"dtype": "int4"}}, "spec.engine.dtype"),
    ({"engine": {"kvCacheMemory": "lots"}}, "spec.engine.kvCacheMemory"),
    ({"tuning": {"mode": "sometimes"}}, "spec.tuning.mode"),
    ({"tuning": {"intervalSeconds": 1}}, "spec.tuning.intervalSeconds"),
    ({"slo": {"ttftP99Ms": 0}}, "spec.slo.ttftP99Ms"),
    ({"resources": {"limits": {"nvidia.com/gpu": "one"}}}, "spec.resources.limits.nvidia.com/gpu"),
    ({"tolerations": [{"operator": "Maybe"}]}, "spec.tolerations.0.operator"),
    ({"apiKeySecretRef": {"key": "k"}}, "spec.apiKeySecretRef"),
    ({"drainTimeoutSeconds": 7200}, "spec.drainTimeoutSeconds"),
    ({"networkPolicy": {"enabled": "yes"}}, "spec.networkPolicy.enabled"),
    ({"networkPolicy": {"apiFrom": [{"ipBlock": {"except": []}}]}}, "spec.networkPolicy.apiFrom.0.ipBlock"),
    ({"router": {"enabled": 1}}, "spec.router.enabled"),
    ({"router": {"policy": "round-robin"}}, "spec.router.policy"),
    ({"router": {"replicas": 0}}, "spec.router.replicas"),
    ({"router": {"resources": {"limits": {"cpu": "two"}}}}, "spec.router.resources.limits.cpu"),
])
def test_schema_rejects_bad_fields_by_name(changes, field):
    errors = schema_errors(sample(**changes))
    assert any(e.startswith(field + ":") for e in errors), errors


def apply_defaults(schema: dict, value):
    """Structural defaulting as the API server does it: a missing property with a default gets it,
    then defaults apply inside it too."""
    if isinstance(value, dict):
        for name, child in (schema.get("properties") or {}).items():
            if name not in value and "default" in child:
                value[name] = copy.deepcopy(child["default"])
            if name in value:
                apply_defaults(child, value[name])
    return value


def test_crd_defaults_match_the_operators():
    minimal = {"metadata": {"name": "x", "namespace": "n", "uid": "u"}, "spec": {}}
    defaulted = apply_defaults(SCHEMA, copy.deepcopy(minimal))
    assert defaulted["spec"]["engine"]["dtype"] == "auto"  # defaulting reached the nested fields
    assert parse_llmservice(defaulted) == parse_llmservice(minimal)
