"""The kubelet stand-in reads pod specs as a kubelet does: `$(VAR)` expansion, env sources, argv rewrites."""

from __future__ import annotations

import base64

import pytest

from tests.kubelet_podspec import (
    ContainerConfigError,
    container_argv,
    container_ports,
    decode_secret_data,
    expand_vars,
    main_container,
    readiness_target,
    remap_path,
    resolve_env,
    with_option,
)
from tests.kubelet_status import PodState, pod_status

ENV = {"A": "1", "EMPTY": ""}


@pytest.mark.parametrize("text, expected", [
    ("--x $(A)", "--x 1"),
    ("$(A)$(A)", "11"),
    ("$(EMPTY)", ""),
    ("$(MISSING)", "$(MISSING)"),
    ("$$(A)", "$(A)"),
    ("$$", "$"),
    ("cost $5", "cost $5"),
    ("$(A", "$(A"),
    ("trailing $", "trailing $"),
])
def test_expand_vars_follows_kubernetes(text, expected):
    assert expand_vars(text, ENV) == expected


POD = {"metadata": {"name": "p", "namespace": "ns"}, "spec": {"nodeName": "local-0"}}
CONFIGMAPS = {"knobs": {"max-num-seqs": "8"}}
SECRETS = {"admin": {"token": "s3cret"}}


def env_of(container: dict) -> dict:
    return resolve_env(POD, container, read_configmap=CONFIGMAPS.get, read_secret=SECRETS.get, pod_ip="127.0.0.2")


@pytest.mark.parametrize("env, expected", [
    ([{"name": "X", "value": "a"}, {"name": "Y", "value": "$(X)-b"}], {"X": "a", "Y": "a-b"}),
    ([{"name": "N", "valueFrom": {"configMapKeyRef": {"name": "knobs", "key": "max-num-seqs"}}}], {"N": "8"}),
    ([{"name": "T", "valueFrom": {"secretKeyRef": {"name": "admin", "key": "token"}}}], {"T": "s3cret"}),
    ([{"name": "O", "valueFrom": {"secretKeyRef": {"name": "absent", "key": "k", "optional": True}}}], {}),
    ([{"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
      {"name": "NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}], {"IP": "127.0.0.2", "NAME": "p"}),
])
def test_resolve_env(env, expected):
    assert env_of({"name": "server", "env": env}) == expected


def test_env_from_with_prefix_then_env_overrides():
    container = {"envFrom": [{"configMapRef": {"name": "knobs"}, "prefix": "K_"}, {"secretRef": {"name": "admin"}}],
                 "env": [{"name": "token", "value": "literal wins"}]}
    assert env_of(container) == {"K_max-num-seqs": "8", "token": "literal wins"}


@pytest.mark.parametrize("container, message", [
    ({"env": [{"name": "N", "valueFrom": {"configMapKeyRef": {"name": "knobs", "key": "nope"}}}]}, "knobs/nope"),
    ({"env": [{"name": "N", "valueFrom": {"secretKeyRef": {"name": "absent", "key": "k"}}}]}, "absent/k"),
    ({"envFrom": [{"configMapRef": {"name": "absent"}}]}, "absent"),
    ({"env": [{"name": "N", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu"}}}]}, "resourceFieldRef"),
])
def test_unresolvable_env_is_a_container_config_error(container, message):
    with pytest.raises(ContainerConfigError, match=message):
        env_of(container)


def test_secret_data_is_decoded():
    assert decode_secret_data({"k": base64.b64encode(b"v").decode()}) == {"k": "v"}
    assert decode_secret_data(None) == {}


@pytest.mark.parametrize("argv, expected", [
    (["serve", "--host", "0.0.0.0", "--port", "8000"], ["serve", "--host", "H", "--port", "8000"]),
    (["serve", "--host=0.0.0.0"], ["serve", "--host=H"]),
    (["serve"], ["serve", "--host", "H"]),
])
def test_with_option(argv, expected):
    assert with_option(argv, "--host", "H") == expected


@pytest.mark.parametrize("path, expected", [
    ("/models/x.gguf", "/tmp/m/x.gguf"),
    ("/models", "/tmp/m"),
    ("/models-other/x", "/models-other/x"),
    ("/models/deep/y", "/tmp/deep/y"),
])
def test_remap_path_takes_the_longest_whole_prefix(path, expected):
    assert remap_path(path, {"/models/": "/tmp/m", "/models/deep": "/tmp/deep"}) == expected


def test_container_argv():
    container = {"command": ["iterserve", "serve"],
                 "args": ["--host", "0.0.0.0", "--port", "8000", "--max-num-seqs", "$(N)", "--model", "/models/tiny"]}
    argv = container_argv(container, {"N": "8"}, iterserve_bin="/venv/bin/iterserve", host="127.0.0.5",
                          extra_args=["--threads", "1"], model_paths={"/models": "/tmp/models"})
    assert argv == ["/venv/bin/iterserve", "serve", "--host", "127.0.0.5", "--port", "8000", "--max-num-seqs", "8",
                    "--model", "/tmp/models/tiny", "--threads", "1"]
    with pytest.raises(ContainerConfigError, match="no command"):
        container_argv({"args": ["x"]}, {}, iterserve_bin="i", host="h")


@pytest.mark.parametrize("container, expected", [
    ({"readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}},
      "ports": [{"name": "http", "containerPort": 9}]},
     ("/ready", 9)),
    ({"readinessProbe": {"httpGet": {"path": "/r", "port": 7}}}, ("/r", 7)),
    ({"args": ["--port=8123"]}, ("/ready", 8123)),
    ({"ports": [{"containerPort": 81}]}, ("/ready", 81)),
    ({}, ("/ready", 8000)),
])
def test_readiness_target(container, expected):
    assert readiness_target(container) == expected


def test_main_container_prefers_server():
    pod = {"spec": {"containers": [{"name": "sidecar"}, {"name": "server"}]}}
    assert main_container(pod)["name"] == "server"
    assert main_container({"spec": {"containers": [{"name": "only"}]}})["name"] == "only"


def test_pod_status_follows_the_process():
    state = PodState(container_name="server", image="img")
    status = pod_status(state, {})
    assert status["phase"] == "Pending" and "podIP" not in status
    assert status["containerStatuses"][0]["state"] == {"waiting": {"reason": "ContainerCreating"}}

    state.set_running(pid=42, host="127.0.0.3")
    state.set_ready(True)
    status = pod_status(state, {})
    conditions = {c["type"]: c["status"] for c in status["conditions"]}
    assert (status["phase"], status["podIP"], conditions["Ready"]) == ("Running", "127.0.0.3", "True")
    assert status["containerStatuses"][0]["containerID"] == "local://42"

    state.set_crashed(exit_code=-9)  # Popen's code for SIGKILL
    status = pod_status(state, {})
    container = status["containerStatuses"][0]
    assert (container["restartCount"], container["ready"]) == (1, False)
    assert container["lastState"]["terminated"]["exitCode"] == 137
    assert container["state"]["waiting"]["reason"] == "CrashLoopBackOff"

    state.set_finished(exit_code=0)
    assert pod_status(state, {})["phase"] == "Succeeded"


@pytest.mark.parametrize("container, expected", [
    ({"ports": [{"name": "http", "containerPort": 8000}, {"name": "admin", "containerPort": 8001}]}, [8000, 8001]),
    ({}, []),
])
def test_container_ports(container, expected):
    assert container_ports(container) == expected
