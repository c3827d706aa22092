"""The contract between the operator and the server, spelled once in common/wire.py: the CRD and both
sides agree with it, the pod the operator builds starts a server with the knobs it meant (its args,
expanded as the kubelet does, parsed by the server's real parser), and the server exports every metric
the tuner reads."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import yaml

from iterserve.common import wire
from iterserve.common.wire import Knobs
from iterserve.operator.builders.configmap import build_knobs_configmap
from iterserve.operator.builders.deployment import build_deployment
from iterserve.operator.builders.secret import token_digest
from iterserve.operator.spec import DEFAULT_KNOBS, parse_llmservice
from iterserve.operator.tuning.observation import COUNTERS, GAUGES, HISTOGRAMS, SERVER_ERRORS
from iterserve.server.config import EngineConfig
from iterserve.server.entrypoints import serve_cmd
from iterserve.server.entrypoints.cli import build_parser
from iterserve.server.entrypoints.cli_args import engine_config_from_args
from tests.server_support import InProcessServer

ROOT = Path(__file__).resolve().parents[1]


def _spec_schema() -> dict:
    crd = yaml.safe_load((ROOT / "crds" / "llmservice.yaml").read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]


def test_the_crd_describes_the_wire_defaults_and_has_its_limits():
    # no schema default: the operator fills a left-out knob in, inside the tuner's bounds (operator/spec.py)
    spec = _spec_schema()
    engine = spec["engine"]["properties"]
    bounds = spec["tuning"]["properties"]["bounds"]["properties"]
    for knob in wire.KNOBS:
        assert "default" not in engine[knob.camel], knob.camel
        assert f"left out: {knob.default}," in engine[knob.camel]["description"], knob.camel
        assert engine[knob.camel]["maximum"] == wire.KNOB_LIMIT, knob.camel
        for end in ("min", "max"):
            assert bounds[knob.camel]["properties"][end]["maximum"] == wire.KNOB_LIMIT, (knob.camel, end)


def test_both_sides_start_from_the_wire_defaults():
    defaults = dict(wire.KNOB_DEFAULTS)
    args = build_parser().parse_args(["serve"])
    config = engine_config_from_args(args)
    assert {k: getattr(EngineConfig(), k) for k in defaults} == defaults
    assert {k: getattr(config, k) for k in defaults} == defaults
    assert Knobs().as_dict() == defaults and DEFAULT_KNOBS == defaults
    assert args.port == wire.HTTP_PORT


def _kubelet_env(container: dict, configmap: dict, secrets: dict[str, str]) -> dict[str, str]:
    """The container's env as the kubelet resolves it: plain values, ConfigMap keys, Secret keys."""
    env = {}
    for var in container["env"]:
        source = var.get("valueFrom", {})
        if "value" in var:
            env[var["name"]] = var["value"]
        elif "configMapKeyRef" in source:
            env[var["name"]] = configmap["data"][source["configMapKeyRef"]["key"]]
        else:
            env[var["name"]] = secrets[var["name"]]
    return env


def test_the_operators_pod_starts_a_server_with_the_knobs_it_meant(monkeypatch):
    svc = parse_llmservice({
        "apiVersion": "iterserve.io/v1alpha1", "kind": "LLMService",
        "metadata": {"name": "chat", "namespace": "team-a", "uid": "u-1", "generation": 1},
        "spec": {"apiKeySecretRef": {"name": "chat-key", "key": "k"}, "maxQueue": 50,
                 "engine": {"maxModelLen": 1024, "threads": 2, "maxNumSeqs": 16, "enablePrefixCaching": False}}})
    in_force = {"max_num_seqs": 24, "max_num_batched_tokens": 1024, "prefill_chunk_size": 128}  # e.g. tuned
    configmap = build_knobs_configmap(svc, in_force)
    container = build_deployment(svc, token_digest("t0k3n"))["spec"]["template"]["spec"]["containers"][0]
    env = _kubelet_env(container, configmap, {wire.ADMIN_TOKEN_ENV: "a" * 32, wire.API_KEY_ENV: "k" * 32})
    args = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in container["args"]]
    for name, value in env.items():  # the server reads its secrets from the env the pod gets
        monkeypatch.setenv(name, value)

    assert container["command"] == ["iterserve", "serve"]
    ns = build_parser().parse_args(["serve", *args])
    serve_cmd._validate(ns)  # what `iterserve serve` checks before it starts
    config = engine_config_from_args(ns)
    assert {k: getattr(config, k) for k in in_force} == in_force
    assert (config.max_model_len, config.num_threads, ns.max_queue) == (1024, 2, 50)
    assert config.enable_prefix_caching is False
    assert (ns.port, ns.admin_port) == (wire.HTTP_PORT, wire.ADMIN_PORT)
    assert (ns.admin_token, ns.api_key) == ("a" * 32, "k" * 32)
    assert {p["containerPort"] for p in container["ports"]} == {wire.HTTP_PORT, wire.ADMIN_PORT}


def test_the_server_exports_every_metric_the_tuner_reads(tiny_dir):
    wanted = [*HISTOGRAMS, *(c for c in COUNTERS if c != SERVER_ERRORS), wire.HTTP_RESPONSES, *GAUGES]
    with InProcessServer(tiny_dir) as server:
        r = httpx.post(server.url + "/v1/completions", json={"model": "test-model", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200, r.text
        text = httpx.get(server.url + "/metrics").text
    families = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    missing = [m for m in wanted if m not in families and m + "_bucket" not in families]
    assert not missing, missing
