"""The children the operator renders, for a table of specs: valid Kubernetes objects (kubernetes-validate,
strict: unknown fields fail) with the args, env, volumes, probes and security settings the spec asks for."""

from __future__ import annotations

import copy
import re

import kubernetes_validate
import pytest

from iterserve.operator.builders.configmap import build_knobs_configmap, knobs_from_configmap
from iterserve.operator.builders.deployment import build_deployment, server_args, termination_grace_seconds
from iterserve.operator.builders.networkpolicy import OperatorPeer, build_network_policy
from iterserve.operator.builders.pdb import build_pdb
from iterserve.operator.builders.secret import token_digest
from iterserve.operator.builders.service import build_service
from iterserve.operator.spec import parse_llmservice

# The oldest and newest schemas kubernetes-validate ships: the objects must be valid on both.
KUBE_VERSIONS = ("1.25", kubernetes_validate.latest_version())
UID = "5f0c7e0e-2d0a-4c4b-9a59-3b1f0c0e0a11"

SPECS = {
    "default-model": {},
    "path-model": {"model": {"source": "path", "path": "/models/tiny.gguf"}, "servedModelName": "tiny"},
    "pvc-model": {"model": {"source": "pvc", "pvcName": "models", "path": "llama/8b"}},
    "pvc-root": {"model": {"source": "pvc", "pvcName": "models"}},
    "gpu": {"resources": {"requests": {"cpu": "4", "memory": "16Gi"}, "limits": {"nvidia.com/gpu": 1}},
            "engine": {"dtype": "bfloat16", "kvCacheMemory": "0.9", "maxModelLen": 4096},
            "nodeSelector": {"nvidia.com/gpu.present": "true"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]},
    "tolerations": {"tolerations": [{"key": "dedicated", "operator": "Equal", "value": "llm",
                                     "effect": "NoExecute", "tolerationSeconds": 60}]},
    "api-key": {"apiKeySecretRef": {"name": "chat-api-key", "key": "key"}},
    "replicas-3": {"replicas": 3, "imagePullSecrets": [{"name": "regcred"}], "imagePullPolicy": "Always"},
    "scaled-to-zero": {"replicas": 0},
    "tuning-auto": {"slo": {"ttftP99Ms": 2000, "itlP99Ms": 200},
                    "engine": {"maxNumSeqs": 24, "prefillChunkSize": 96, "policy": "static", "threads": 2},
                    "tuning": {"mode": "auto", "bounds": {"maxNumSeqs": {"min": 1, "max": 64}}},
                    "drainTimeoutSeconds": 120, "maxQueue": 100},
}


def service(spec: dict, name: str = "chat"):
    return parse_llmservice({"apiVersion": "iterserve.io/v1alpha1", "kind": "LLMService",
                             "metadata": {"name": name, "namespace": "team-a", "uid": UID, "generation": 1},
                             "spec": spec})


def children(spec: dict) -> list[dict]:
    svc = service(spec)
    objs = [build_deployment(svc, token_digest("t0k3n")), build_service(svc),
            build_knobs_configmap(svc, svc.engine.knobs), build_network_policy(svc, OperatorPeer())]
    pdb = build_pdb(svc)
    return objs + ([pdb] if pdb else [])


def validate(obj: dict, version: str) -> None:
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as e:  # its message dumps the whole schema; keep the first line
        pytest.fail(f"{obj['kind']} invalid on {version}: {str(e).splitlines()[0]} at {list(e.absolute_path)}")


@pytest.mark.parametrize("case", SPECS)
def test_children_are_valid_objects(case):
    for obj in children(SPECS[case]):
        for version in KUBE_VERSIONS:
            validate(obj, version)


@pytest.mark.parametrize("case", SPECS)
def test_every_child_is_owned_labelled_and_namespaced(case):
    for obj in children(SPECS[case]):
        meta = obj["metadata"]
        assert meta["namespace"] == "team-a"
        assert meta["ownerReferences"] == [{"apiVersion": "iterserve.io/v1alpha1", "kind": "LLMService",
                                            "name": "chat", "uid": UID, "controller": True,
                                            "blockOwnerDeletion": True}]
        assert meta["labels"] == {"app.kubernetes.io/name": "iterserve", "app.kubernetes.io/instance": "chat",
                                  "app.kubernetes.io/component": "server",
                                  "app.kubernetes.io/managed-by": "iterserve-operator"}


def pod_spec(spec: dict) -> dict:
    return build_deployment(service(spec), "digest")["spec"]["template"]["spec"]


def container(spec: dict) -> dict:
    (c,) = pod_spec(spec)["containers"]
    return c


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


@pytest.mark.parametrize("case, model", [("default-model", None), ("path-model", "/models/tiny.gguf"),
                                         ("pvc-model", "/models/llama/8b"), ("pvc-root", "/models")])
def test_model_source_becomes_the_model_flag(case, model):
    assert flag(container(SPECS[case])["args"], "--model") == model


def test_pvc_model_is_mounted_read_only():
    spec = pod_spec(SPECS["pvc-model"])
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}} in spec["volumes"]
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in spec["containers"][0]["volumeMounts"]
    assert all(v["name"] != "model" for v in pod_spec(SPECS["path-model"])["volumes"])


def test_server_args_carry_the_engine_settings():
    args = server_args(service(SPECS["tuning-auto"]))
    assert args[:4] == ["--host", "0.0.0.0", "--port", "8000"]
    assert (flag(args, "--drain-timeout"), flag(args, "--policy"), flag(args, "--threads"),
            flag(args, "--max-queue")) == ("120", "static", "2", "100")
    gpu = server_args(service(SPECS["gpu"]))
    assert (flag(gpu, "--dtype"), flag(gpu, "--kv-cache-memory"), flag(gpu, "--max-model-len")) == \
        ("bfloat16", "0.9", "4096")
    assert flag(server_args(service(SPECS["path-model"])), "--served-model-name") == "tiny"


def test_prefix_caching_is_on_unless_the_spec_turns_it_off():
    assert "--no-enable-prefix-caching" not in server_args(service(SPECS["default-model"]))
    assert "--no-enable-prefix-caching" not in server_args(service({"engine": {"enablePrefixCaching": True}}))
    assert "--no-enable-prefix-caching" in server_args(service({"engine": {"enablePrefixCaching": False}}))


def test_live_knobs_come_from_the_configmap_not_the_template():
    svc = service(SPECS["tuning-auto"])
    c = container(SPECS["tuning-auto"])
    env = {e["name"]: e for e in c["env"]}
    configmap = build_knobs_configmap(svc, svc.engine.knobs)
    for knob_flag in ("--max-num-seqs", "--max-num-batched-tokens", "--prefill-chunk-size"):
        var = re.fullmatch(r"\$\((\w+)\)", flag(c["args"], knob_flag)).group(1)
        ref = env[var]["valueFrom"]["configMapKeyRef"]
        assert ref["name"] == "chat-knobs" and ref["key"] in configmap["data"]
    assert knobs_from_configmap(configmap) == {"max_num_seqs": 24, "max_num_batched_tokens": 2048,
                                               "prefill_chunk_size": 96}
    assert "24" not in c["args"] and "96" not in c["args"]


def test_knob_only_spec_changes_keep_the_pod_template():
    base = SPECS["tuning-auto"]
    knobs_changed = copy.deepcopy(base)
    knobs_changed["engine"].update(maxNumSeqs=32, maxNumBatchedTokens=1024, prefillChunkSize=64)
    knobs_changed["tuning"]["bounds"]["maxNumSeqs"]["max"] = 128
    template = build_deployment(service(base), "d")["spec"]["template"]
    assert build_deployment(service(knobs_changed), "d")["spec"]["template"] == template
    for change in ({"image": "ghcr.io/iterserve/server:0.2.0"}, {"engine": {**base["engine"], "dtype": "float16"}},
                   {"drainTimeoutSeconds": 5}, {"resources": {"limits": {"nvidia.com/gpu": 2}}}):
        assert build_deployment(service({**base, **change}), "d")["spec"]["template"] != template, change
    assert build_deployment(service(base), "other-token")["spec"]["template"] != template


def test_secrets_reach_the_server_as_env():
    env = {e["name"]: e.get("valueFrom") for e in container(SPECS["api-key"])["env"]}
    assert env["ITERSERVE_ADMIN_TOKEN"] == {"secretKeyRef": {"name": "iterserve-admin-tokens", "key": "chat"}}
    assert env["ITERSERVE_API_KEY"] == {"secretKeyRef": {"name": "chat-api-key", "key": "key"}}
    assert "ITERSERVE_API_KEY" not in {e["name"] for e in container({})["env"]}


def test_probes_drain_and_hardening():
    c = container({"drainTimeoutSeconds": 45})
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    # a scale-out's pod is Ready within a second of its server (the kubelet waits on this probe), and a
    # model may take 10 minutes to load
    startup = c["startupProbe"]
    assert startup["periodSeconds"] == 1 and startup["periodSeconds"] * startup["failureThreshold"] == 600
    assert c["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"},
                          {"name": "admin", "containerPort": 8001, "protocol": "TCP"}]
    assert flag(c["args"], "--admin-port") == "8001"  # the admin API only there (the NetworkPolicy's rule)
    assert c["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"
    spec = pod_spec({"drainTimeoutSeconds": 45})
    prestop = int(c["lifecycle"]["preStop"]["exec"]["command"][1])
    assert spec["terminationGracePeriodSeconds"] == termination_grace_seconds(service({"drainTimeoutSeconds": 45}))
    assert spec["terminationGracePeriodSeconds"] > prestop + 45  # the drain fits in the grace period
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]  # writable scratch under a read-only root
    annotations = build_deployment(service({}), "d")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/port"] == "8000"


def test_scheduling_fields_pass_through():
    spec = pod_spec(SPECS["gpu"])
    assert spec["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": 1}
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert spec["tolerations"] == SPECS["gpu"]["tolerations"]
    assert "resources" not in container({}) and "tolerations" not in pod_spec({})
    assert pod_spec(SPECS["replicas-3"])["imagePullSecrets"] == [{"name": "regcred"}]


@pytest.mark.parametrize("replicas, has_pdb", [(0, False), (1, False), (2, True), (3, True)])
def test_pdb_only_with_more_than_one_replica(replicas, has_pdb):
    pdb = build_pdb(service({"replicas": replicas}))
    assert (pdb is not None) == has_pdb
    if pdb:
        assert pdb["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": {
            "app.kubernetes.io/name": "iterserve", "app.kubernetes.io/instance": "chat"}}}
    assert build_deployment(service({"replicas": replicas}), "d")["spec"]["replicas"] == replicas


def test_service_selects_the_deployments_pods():
    svc = service({})
    deployment, k8s_service = build_deployment(svc, "d"), build_service(svc)
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert k8s_service["spec"]["selector"].items() <= pod_labels.items()
    assert k8s_service["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}]
