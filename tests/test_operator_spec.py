"""Reading an LLMService: defaults, Kubernetes-style field errors for the cross-field rules, and which
knobs the operator puts in force (spec vs tuner)."""

from __future__ import annotations

import copy

import pytest

from iterserve.operator.builders.configmap import build_knobs_configmap
from iterserve.operator.knob_plan import plan_knobs
from iterserve.operator.spec import DEFAULT_IMAGE, Autoscaling, Router, SpecError, parse_llmservice


def body(spec: dict) -> dict:
    return {"metadata": {"name": "chat", "namespace": "ns", "uid": "u1", "generation": 3}, "spec": spec}


def test_empty_spec_gets_the_documented_defaults():
    svc = parse_llmservice(body({}))
    assert (svc.name, svc.namespace, svc.uid, svc.generation) == ("chat", "ns", "u1", 3)
    assert svc.model.source == "default" and svc.image == DEFAULT_IMAGE and svc.replicas == 1
    assert svc.engine.knobs == {"max_num_seqs": 64, "max_num_batched_tokens": 2048, "prefill_chunk_size": 2048}
    assert (svc.engine.dtype, svc.engine.policy, svc.engine.block_size) == ("auto", "continuous", 16)
    assert (svc.tuning.mode, svc.tuning.interval_seconds, svc.tuning.window_seconds) == ("off", 30, 60)
    assert svc.drain_timeout_seconds == 30 and svc.api_key is None


INVALID = [
    ({"model": {"source": "path"}}, "spec.model.path", "required when source is path"),
    ({"model": {"source": "path", "path": "models/x"}}, "spec.model.path", "absolute"),
    ({"model": {"source": "pvc"}}, "spec.model.pvcName", "required when source is pvc"),
    ({"model": {"source": "pvc", "pvcName": "m", "path": "../etc"}}, "spec.model.path", "relative"),
    ({"model": {"source": "default", "pvcName": "m"}}, "spec.model.pvcName", "only used when source is pvc"),
    ({"model": {"source": "s3"}}, "spec.model.source", "must be one of default, path, pvc"),
    ({"engine": {"maxNumSeqs": 0}}, "spec.engine.maxNumSeqs", "must be in [1, 1048576], got 0"),
    ({"engine": {"maxNumSeqs": "8"}}, "spec.engine.maxNumSeqs", "must be an integer"),
    ({"engine": {"dtype": "int4"}}, "spec.engine.dtype", "must be one of"),
    ({"engine": {"maxModelLen": 8}}, "spec.engine.blockSize", "must not exceed maxModelLen (8)"),
    ({"replicas": -1}, "spec.replicas", "must be in [0, 1000]"),
    ({"tuning": {"bounds": {"maxNumSeqs": {"min": 8, "max": 4}}}}, "spec.tuning.bounds.maxNumSeqs",
     "min 8 is above max 4"),
    ({"tuning": {"mode": "auto", "bounds": {"prefillChunkSize": {"max": 128}}}, "slo": {"ttftP99Ms": 500},
      "engine": {"prefillChunkSize": 256}},
     "spec.engine.prefillChunkSize",
     "within spec.tuning.bounds.prefillChunkSize [1, 128] when tuning is auto, got 256"),
    ({"tuning": {"mode": "auto"}}, "spec.slo", "ttftP99Ms"),
    ({"tuning": {"intervalSeconds": 60, "windowSeconds": 30}}, "spec.tuning.windowSeconds", ">= intervalSeconds"),
    ({"tuning": {"mode": "sometimes"}}, "spec.tuning.mode", "must be one of off, observe, auto"),
    ({"apiKeySecretRef": {"key": "k"}}, "spec.apiKeySecretRef.name", "required"),
    ({"apiKeySecretRef": {"name": "iterserve-admin-tokens"}}, "spec.apiKeySecretRef.name", "admin-token Secret"),
    ({"slo": {"ttftP99Ms": 0}}, "spec.slo.ttftP99Ms", "must be a number"),
    ({"tolerations": [{"key": "k", "operator": "Exists", "value": "v"}]}, "spec.tolerations[0].value", "Exists"),
    ({"engine": []}, "spec.engine", "must be an object"),
    ({"autoscaling": {"minReplicas": 2}, "tuning": {"mode": "auto"}, "slo": {"ttftP99Ms": 500}},
     "spec.autoscaling.maxReplicas", "required"),
    ({"autoscaling": {"minReplicas": 5, "maxReplicas": 2}, "tuning": {"mode": "auto"}, "slo": {"ttftP99Ms": 500}},
     "spec.autoscaling.minReplicas", "must not exceed maxReplicas (2), got 5"),
    ({"autoscaling": {"maxReplicas": 4}, "slo": {"ttftP99Ms": 500}}, "spec.tuning.mode", "must be observe or auto"),
    ({"autoscaling": {"maxReplicas": 4}, "tuning": {"mode": "observe"}}, "spec.slo", "spec.autoscaling scales"),
    ({"autoscaling": {"maxReplicas": 1001}, "tuning": {"mode": "auto"}, "slo": {"ttftP99Ms": 500}},
     "spec.autoscaling.maxReplicas", "must be in [1, 1000]"),
    ({"autoscaling": {"maxReplicas": 4, "scaleDownStabilizationSeconds": -1}, "tuning": {"mode": "auto"},
      "slo": {"ttftP99Ms": 500}}, "spec.autoscaling.scaleDownStabilizationSeconds", "must be in [0, 3600]"),
    ({"router": {"enabled": "yes"}}, "spec.router.enabled", "must be true or false"),
    ({"router": {"enabled": True, "policy": "round-robin"}}, "spec.router.policy",
     "must be one of least-load, prefix-hash, got 'round-robin'"),
    ({"router": {"enabled": True, "replicas": 0}}, "spec.router.replicas", "must be in [1, 100], got 0"),
    ({"router": {"replicas": 2.5}}, "spec.router.replicas", "must be an integer"),
    ({"router": {"resources": "small"}}, "spec.router.resources", "must be an object"),
    ({"router": True}, "spec.router", "must be an object"),
]


def test_router_defaults_and_fields():
    assert parse_llmservice(body({})).router == Router(enabled=False, policy="least-load", replicas=1, resources={})
    assert parse_llmservice(body({"router": {}})).router == Router()
    svc = parse_llmservice(body({"router": {"enabled": True, "policy": "prefix-hash", "replicas": 3,
                                            "resources": {"requests": {"cpu": "500m"}}}}))
    assert svc.router == Router(enabled=True, policy="prefix-hash", replicas=3,
                                resources={"requests": {"cpu": "500m"}})


def test_autoscaling_defaults_and_absence():
    assert parse_llmservice(body({})).autoscaling is None
    svc = parse_llmservice(body({"autoscaling": {"maxReplicas": 8}, "tuning": {"mode": "observe"},
                                 "slo": {"itlP99Ms": 80}}))
    assert svc.autoscaling == Autoscaling(min_replicas=1, max_replicas=8, scale_up_stabilization_seconds=0,
                                          scale_down_stabilization_seconds=300)


@pytest.mark.parametrize("spec, field, message", INVALID, ids=[case[1] + ":" + case[2][:20] for case in INVALID])
def test_invalid_specs_name_the_field(spec, field, message):
    with pytest.raises(SpecError) as e:
        parse_llmservice(body(spec))
    assert any(path == field and message in text for path, text in e.value.errors), e.value.errors
    assert f"{field}: " in str(e.value)


def test_all_errors_are_reported_at_once():
    with pytest.raises(SpecError) as e:
        parse_llmservice(body({"model": {"source": "pvc"}, "engine": {"maxNumSeqs": 0}, "replicas": -1}))
    assert {path for path, _ in e.value.errors} == {"spec.model.pvcName", "spec.engine.maxNumSeqs", "spec.replicas"}


def test_auto_tuning_within_bounds_is_valid():
    svc = parse_llmservice(body({"slo": {"itlP99Ms": 100}, "engine": {"maxNumSeqs": 8},
                                 "tuning": {"mode": "auto", "bounds": {"maxNumSeqs": {"min": 2, "max": 8}}}}))
    assert svc.tuning.bounds["max_num_seqs"].min == 2 and svc.itl_p99_ms == 100.0


@pytest.mark.parametrize(("mode", "bounds", "engine", "expected"), [
    ("off", {"prefillChunkSize": {"max": 512}}, {}, (64, 2048, 2048)),  # bounds only bind the tuner
    ("auto", {}, {}, (64, 2048, 2048)),
    ("auto", {"prefillChunkSize": {"min": 64, "max": 512}}, {}, (64, 2048, 512)),  # pulled down into the bounds
    ("auto", {"maxNumSeqs": {"min": 96}}, {}, (96, 2048, 2048)),  # and up
    ("auto", {"prefillChunkSize": {"max": 512}}, {"prefillChunkSize": 256}, (64, 2048, 256)),  # written: kept
])
def test_a_left_out_knob_starts_at_its_default_inside_the_tuners_bounds(mode, bounds, engine, expected):
    svc = parse_llmservice(body({"slo": {"ttftP99Ms": 1000}, "engine": engine,
                                 "tuning": {"mode": mode, "bounds": bounds}}))
    assert tuple(svc.engine.knobs.values()) == expected


AUTO = {"slo": {"ttftP99Ms": 1000}, "engine": {"maxNumSeqs": 16, "prefillChunkSize": 128},
        "tuning": {"mode": "auto", "bounds": {"maxNumSeqs": {"min": 1, "max": 64}}}}


def svc_of(spec):
    return parse_llmservice(body(spec))


def configmap(spec, knobs):
    """The ConfigMap as the operator wrote it for `spec`, with `knobs` in force (e.g. after the tuner)."""
    svc = svc_of(spec)
    return build_knobs_configmap(svc, {**svc.engine.knobs, **knobs})


def with_engine(spec, **engine):
    out = copy.deepcopy(spec)
    out.setdefault("engine", {}).update(engine)
    return out


PLANS = [
    # (spec now, configmap as stored, knobs expected in force, reason contains)
    ("first reconcile", AUTO, None, {"max_num_seqs": 16, "prefill_chunk_size": 128}, "initial"),
    ("tuning off: spec wins over an edited ConfigMap", {}, configmap({}, {"max_num_seqs": 3}),
     {"max_num_seqs": 64}, "spec.engine"),
    ("observe: spec wins", {"tuning": {"mode": "observe"}}, configmap({}, {"max_num_seqs": 3}),
     {"max_num_seqs": 64}, "spec.engine"),
    ("off and in line: nothing to do", {}, configmap({}, {}), {"max_num_seqs": 64}, ""),
    ("auto: the tuner's values stay", AUTO, configmap(AUTO, {"max_num_seqs": 40, "prefill_chunk_size": 64}),
     {"max_num_seqs": 40, "prefill_chunk_size": 64}, ""),
    ("auto: a spec edit of one knob applies that knob only", with_engine(AUTO, maxNumSeqs=8),
     configmap(AUTO, {"max_num_seqs": 40, "prefill_chunk_size": 64}),
     {"max_num_seqs": 8, "prefill_chunk_size": 64}, "spec.engine changed"),
    ("auto: narrowed bounds pull the value in", {**AUTO, "tuning": {"mode": "auto", "bounds": {
        "maxNumSeqs": {"min": 1, "max": 32}}}}, configmap(AUTO, {"max_num_seqs": 40}),
     {"max_num_seqs": 32}, "bounds"),
    ("auto -> off: back to the spec", {**AUTO, "tuning": {"mode": "off"}}, configmap(AUTO, {"max_num_seqs": 40}),
     {"max_num_seqs": 16}, "tuning off"),
]


@pytest.mark.parametrize("title, spec, stored, expected, reason", PLANS, ids=[p[0] for p in PLANS])
def test_plan_knobs(title, spec, stored, expected, reason):
    plan = plan_knobs(svc_of(spec), stored)
    assert {k: plan.knobs[k] for k in expected} == expected
    assert (reason in plan.reason) if reason else plan.reason == ""


def test_plan_ignores_a_configmap_with_a_broken_value():
    broken = configmap(AUTO, {})
    broken["data"]["max-num-seqs"] = "lots"
    assert plan_knobs(svc_of(AUTO), broken).knobs["max_num_seqs"] == 16
