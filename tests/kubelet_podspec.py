"""What the kubelet stand-in reads from a pod spec, as pure functions over the pod's JSON (camelCase dicts):
the container to run, its environment, its command line and where its readiness probe points."""

from __future__ import annotations

import base64
from collections.abc import Callable, Mapping, Sequence

# name -> the object's data (a Secret's decoded), or None when it does not exist
DataReader = Callable[[str], "Mapping[str, str] | None"]


class ContainerConfigError(Exception):
    """What a kubelet reports as CreateContainerConfigError (e.g. a referenced ConfigMap key is missing)."""


def main_container(pod: Mapping) -> dict:
    """The container named `server`, else the first one."""
    containers = pod["spec"]["containers"]
    return next((c for c in containers if c["name"] == "server"), containers[0])


def expand_vars(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion: defined references are replaced, undefined ones stay as written,
    `$$` is an escaped `$` (so `$$(VAR)` gives `$(VAR)`)."""
    out, i = [], 0
    while i < len(text):
        if text[i] != "$" or i + 1 == len(text):
            out.append(text[i])
            i += 1
        elif text[i + 1] == "$":
            out.append("$")
            i += 2
        elif text[i + 1] == "(" and (end := text.find(")", i + 2)) != -1:
            name = text[i + 2:end]
            out.append(env[name] if name in env else text[i:end + 1])
            i = end + 1
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def resolve_env(pod: Mapping, container: Mapping, *, read_configmap: DataReader, read_secret: DataReader,
                pod_ip: str) -> dict[str, str]:
    """The container's environment as the kubelet builds it: `envFrom` first, then `env` in order, each
    literal value expanded against the variables defined before it."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        for ref_kind, reader in (("configMapRef", read_configmap), ("secretRef", read_secret)):
            if ref := source.get(ref_kind):
                data = reader(ref["name"])
                if data is None and not ref.get("optional", False):
                    raise ContainerConfigError(f"envFrom {ref_kind} {ref['name']} not found")
                env.update({source.get("prefix", "") + key: value for key, value in (data or {}).items()})
    for var in container.get("env", []):
        if "valueFrom" not in var:
            env[var["name"]] = expand_vars(var.get("value", ""), env)
            continue
        value = _value_from(pod, var["valueFrom"], read_configmap, read_secret, pod_ip)
        if value is not None:
            env[var["name"]] = value
    return env


def _value_from(pod, value_from: Mapping, read_configmap: DataReader, read_secret: DataReader,
                pod_ip: str) -> str | None:
    for ref_kind, reader in (("configMapKeyRef", read_configmap), ("secretKeyRef", read_secret)):
        if ref := value_from.get(ref_kind):
            value = (reader(ref["name"]) or {}).get(ref["key"])
            if value is None and not ref.get("optional", False):
                raise ContainerConfigError(f"{ref_kind} {ref['name']}/{ref['key']} not found")
            return value
    if ref := value_from.get("fieldRef"):
        fields = {"metadata.name": pod["metadata"]["name"], "metadata.namespace": pod["metadata"]["namespace"],
                  "status.podIP": pod_ip, "spec.nodeName": pod["spec"].get("nodeName", "")}
        if ref["fieldPath"] not in fields:
            raise ContainerConfigError(f"fieldRef {ref['fieldPath']} is not supported by the kubelet stand-in")
        return fields[ref["fieldPath"]]
    raise ContainerConfigError(f"valueFrom {sorted(value_from)} is not supported by the kubelet stand-in")


def decode_secret_data(data: Mapping[str, str] | None) -> dict[str, str]:
    return {key: base64.b64decode(value).decode() for key, value in (data or {}).items()}


def with_option(argv: Sequence[str], option: str, value: str) -> list[str]:
    """argv with every `option VALUE` / `option=VALUE` set to `value`, or `option value` appended."""
    out, found, i = [], False, 0
    while i < len(argv):
        arg = argv[i]
        if arg == option and i + 1 < len(argv):
            out += [option, value]
            found, i = True, i + 2
            continue
        if arg.startswith(option + "="):
            out.append(f"{option}={value}")
            found = True
        else:
            out.append(arg)
        i += 1
    return out if found else out + [option, value]


def option_value(argv: Sequence[str], option: str) -> str | None:
    """The last value given to `option` in argv (argparse keeps the last), else None."""
    value = None
    for i, arg in enumerate(argv):
        if arg == option and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(option + "="):
            value = arg.split("=", 1)[1]
    return value


def remap_path(path: str, path_map: Mapping[str, str]) -> str:
    """`path` with its longest mapped prefix (a whole path component) replaced: {"/models": "/tmp/m"}
    turns /models/x.gguf into /tmp/m/x.gguf."""
    for prefix in sorted(path_map, key=len, reverse=True):
        base = prefix.rstrip("/")
        if path == base or path.startswith(base + "/"):
            return path_map[prefix].rstrip("/") + path[len(base):]
    return path


def container_argv(container: Mapping, env: Mapping[str, str], *, iterserve_bin: str, host: str,
                   extra_args: Sequence[str] = (), model_paths: Mapping[str, str] | None = None) -> list[str]:
    """The local command line for a container: `$(VAR)`s expanded, `iterserve` mapped to the local
    binary, `--host` forced to the pod's loopback address, `--model` remapped, extra args appended."""
    words = [expand_vars(w, env) for w in [*container.get("command", []), *container.get("args", [])]]
    if not container.get("command"):
        raise ContainerConfigError("the container has no command: the stand-in cannot run an image's entrypoint")
    if words[0] == "iterserve":
        words[0] = iterserve_bin
    words = with_option(words, "--host", host)
    if model_paths and (model := option_value(words, "--model")) is not None:
        words = with_option(words, "--model", remap_path(model, model_paths))
    return words + list(extra_args)


def container_ports(container: Mapping) -> list[int]:
    """The ports the container declares (`containerPort`s): its process listens on each."""
    return [int(port["containerPort"]) for port in container.get("ports", ())]


def readiness_target(container: Mapping) -> tuple[str, int]:
    """(path, port) the readiness probe calls: the probe's httpGet (named ports resolved), else `/ready`
    on the `--port` in the args, the first containerPort, or 8000."""
    ports = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
    http_get = (container.get("readinessProbe") or {}).get("httpGet")
    if http_get:
        port = http_get["port"]
        return http_get.get("path", "/"), int(ports[port] if isinstance(port, str) and port in ports else port)
    argv = [*container.get("command", []), *container.get("args", [])]
    if (port := option_value(argv, "--port")) is not None and port.isdigit():
        return "/ready", int(port)
    first_port = container.get("ports", [{}])[0].get("containerPort") if container.get("ports") else None
    return "/ready", int(first_port or 8000)
