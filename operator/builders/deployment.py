"""The Deployment running `iterserve serve` for one LLMService.

Everything here is in the pod template, so changing it rolls the pods, except the live knobs: their
values come from ConfigMap `<name>-knobs` through env vars expanded in the args (`$(VAR)`), so the
template stays the same when they change and running pods get the new values over HTTP instead.
"""

from __future__ import annotations

from iterserve.common import wire
from iterserve.operator.builders.configmap import configmap_key, env_var
from iterserve.operator.builders.labels import (
    ADMIN_PORT,
    ADMIN_PORT_NAME,
    ANNOTATION_PREFIX,
    HTTP_PORT,
    child_metadata,
    knobs_configmap_name,
    pod_labels,
    selector_labels,
)
from iterserve.operator.builders.secret import ADMIN_SECRET
from iterserve.operator.spec import LLMService

CONTAINER = "server"
MODEL_MOUNT = "/models"
RUN_AS = 10001  # the image's unprivileged user (manifests/Dockerfile.server)
# The Service drops a terminating pod from its endpoints asynchronously; waiting this long before the
# SIGTERM keeps new requests off a pod that is about to answer them with 503.
PRESTOP_SLEEP_S = 5
# After --drain-timeout the server aborts what is left and uvicorn takes up to 5 s to close connections.
SHUTDOWN_MARGIN_S = 10
TOKEN_DIGEST_ANNOTATION = ANNOTATION_PREFIX + "admin-token-digest"
SCRAPE_ANNOTATIONS = {"prometheus.io/scrape": "true", "prometheus.io/port": str(HTTP_PORT),
                      "prometheus.io/path": "/metrics"}


def model_path(svc: LLMService) -> str | None:
    """The --model argument: None for the bundled default."""
    if svc.model.source == "path":
        return svc.model.path
    if svc.model.source == "pvc":
        return f"{MODEL_MOUNT}/{svc.model.path}" if svc.model.path else MODEL_MOUNT
    return None


def server_args(svc: LLMService) -> list[str]:
    e = svc.engine
    args = ["--host", "0.0.0.0", "--port", str(HTTP_PORT), "--admin-port", str(ADMIN_PORT),
            "--drain-timeout", str(svc.drain_timeout_seconds)]
    optional = [
        ("--model", model_path(svc)),
        ("--served-model-name", svc.served_model_name),
        ("--max-queue", svc.max_queue),
        ("--dtype", e.dtype),
        ("--max-model-len", e.max_model_len),
        ("--kv-cache-memory", e.kv_cache_memory),
        ("--block-size", e.block_size),
        ("--policy", e.policy),
        ("--threads", e.threads),
    ]
    for flag, value in optional:
        if value is not None:
            args += [flag, str(value)]
    if not e.enable_prefix_caching:  # on is the server's default
        args.append("--no-enable-prefix-caching")
    for knob in wire.KNOBS:  # expanded by the kubelet from the env below, i.e. from the ConfigMap
        args += [knob.flag, f"$({knob.env})"]
    return args


def _env(svc: LLMService) -> list[dict]:
    env = [{"name": env_var(knob),
            "valueFrom": {"configMapKeyRef": {"name": knobs_configmap_name(svc.name), "key": configmap_key(knob)}}}
           for knob in wire.KNOB_NAMES]
    env.append({"name": wire.ADMIN_TOKEN_ENV,
                "valueFrom": {"secretKeyRef": {"name": ADMIN_SECRET, "key": svc.name}}})
    if svc.api_key is not None:
        env.append({"name": wire.API_KEY_ENV,
                    "valueFrom": {"secretKeyRef": {"name": svc.api_key.name, "key": svc.api_key.key}}})
    env.append({"name": "HOME", "value": "/tmp"})  # caches (torch, triton) go to the writable volume
    return env


def _volumes(svc: LLMService) -> tuple[list[dict], list[dict]]:
    volumes: list[dict] = [{"name": "tmp", "emptyDir": {}}]
    mounts: list[dict] = [{"name": "tmp", "mountPath": "/tmp"}]
    if svc.model.source == "pvc":
        volumes.append({"name": "model", "persistentVolumeClaim": {"claimName": svc.model.pvc_name, "readOnly": True}})
        mounts.append({"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True})
    return volumes, mounts


def http_probe(path: str, period: int, failures: int) -> dict:
    return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period, "timeoutSeconds": 3,
            "failureThreshold": failures}


def hardened_container() -> dict:
    """The container fields every pod of a service shares (server and router): a writable /tmp under a
    read-only root, no privileges, the Service told to stop sending before the SIGTERM."""
    return {"lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_SLEEP_S)]}}},
            "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}}}


def hardened_pod_spec(svc: LLMService, container: dict, volumes: list[dict], grace_seconds: int) -> dict:
    """A pod spec around `container` that never calls the Kubernetes API, runs as the image's user and
    pulls as the spec says."""
    spec = {
        "containers": [container],
        "volumes": volumes,
        "terminationGracePeriodSeconds": grace_seconds,
        "automountServiceAccountToken": False,  # neither the server nor the router calls the Kubernetes API
        "enableServiceLinks": False,
        "securityContext": {"runAsNonRoot": True, "runAsUser": RUN_AS, "runAsGroup": RUN_AS, "fsGroup": RUN_AS,
                            "seccompProfile": {"type": "RuntimeDefault"}},
    }
    if svc.image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": name} for name in svc.image_pull_secrets]
    if svc.image_pull_policy:
        container["imagePullPolicy"] = svc.image_pull_policy
    return spec


def container_resources(resources: dict) -> dict:
    return {key: dict(value) for key, value in resources.items() if value}


def _container(svc: LLMService) -> dict:
    _, mounts = _volumes(svc)
    container = {
        "name": CONTAINER,
        "image": svc.image,
        "command": ["iterserve", "serve"],
        "args": server_args(svc),
        "env": _env(svc),
        "ports": [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"},
                  {"name": ADMIN_PORT_NAME, "containerPort": ADMIN_PORT, "protocol": "TCP"}],
        # loading a model can take minutes: liveness starts counting only once /health answered. Probed
        # every second (the same 10 minutes at most): the kubelet holds readiness back until this probe
        # passes, so its period is added to every scale-out's start (2.5 s on average at 5 s, where the
        # bundled model's pod starts in 5)
        "startupProbe": http_probe("/health", 1, 600),
        "livenessProbe": http_probe("/health", 10, 3),
        "readinessProbe": http_probe("/ready", 5, 2),
        "volumeMounts": mounts,
        **hardened_container(),
    }
    if svc.resources:
        container["resources"] = container_resources(svc.resources)
    return container


def termination_grace_seconds(svc: LLMService) -> int:
    return PRESTOP_SLEEP_S + svc.drain_timeout_seconds + SHUTDOWN_MARGIN_S


def build_deployment(svc: LLMService, admin_token_digest: str) -> dict:
    """`admin_token_digest` (secret.token_digest) is in the template so that a new admin token rolls the pods."""
    volumes, _ = _volumes(svc)
    pod_spec = hardened_pod_spec(svc, _container(svc), volumes, termination_grace_seconds(svc))
    if svc.node_selector:
        pod_spec["nodeSelector"] = dict(svc.node_selector)
    if svc.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in svc.tolerations]
    annotations = {**SCRAPE_ANNOTATIONS, TOKEN_DIGEST_ANNOTATION: admin_token_digest}
    return rolling_deployment(child_metadata(svc, svc.name), svc.replicas, selector_labels(svc.name),
                              pod_labels(svc.name), annotations, pod_spec)


def rolling_deployment(metadata: dict, replicas: int, selector: dict[str, str], pod_labels: dict[str, str],
                       annotations: dict[str, str], pod_spec: dict) -> dict:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata,
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector},
            # a new pod must be ready before an old one goes (needs room for one more pod, e.g. one more GPU)
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "revisionHistoryLimit": 3,
            "template": {"metadata": {"labels": pod_labels, "annotations": annotations}, "spec": pod_spec},
        },
    }
