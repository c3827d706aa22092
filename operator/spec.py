"""`LLMService`: an LLMService resource read into one validated dataclass, with the CRD's defaults.

The API server's schema (crds/llmservice.yaml) already rejects wrong types, ranges and enums; this
module applies the same defaults (for objects stored before a default existed) and checks what a
structural schema cannot: rules across fields. Every problem is reported Kubernetes-style, naming the
field (`spec.tuning.bounds.maxNumSeqs: min 8 is above max 4`), all of them at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from iterserve.common import wire
from iterserve.common.wire import KNOB_LIMIT, KNOB_NAMES

DEFAULT_IMAGE = "ghcr.io/iterserve/server:0.1.0"
ADMIN_SECRET = "iterserve-admin-tokens"  # the operator's own Secret in each namespace (builders/secret.py)
MODEL_SOURCES = ("default", "path", "pvc")
DTYPES = ("auto", "float32", "bfloat16", "float16")
POLICIES = ("continuous", "static")
TUNING_MODES = ("off", "observe", "auto")
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
ROUTER_POLICIES = ("least-load", "prefix-hash")  # `iterserve router --policy` (router/cli.py)
DEFAULT_KNOBS = dict(wire.KNOB_DEFAULTS)


def camel(snake: str) -> str:
    head, *rest = snake.split("_")
    return head + "".join(part.title() for part in rest)


class SpecError(ValueError):
    """One or more invalid fields; `errors` holds (field path, message) pairs."""

    def __init__(self, errors: list[tuple[str, str]]):
        self.errors = errors
        super().__init__("; ".join(f"{path}: {message}" for path, message in errors))


@dataclass(frozen=True)
class Bound:
    min: int = 1
    max: int = KNOB_LIMIT

    def clamp(self, value: int) -> int:
        return min(max(value, self.min), self.max)


@dataclass(frozen=True)
class ModelSource:
    source: str = "default"
    path: str | None = None
    pvc_name: str | None = None


@dataclass(frozen=True)
class Engine:
    knobs: dict[str, int]  # snake_case knob -> initial value
    dtype: str = "auto"
    max_model_len: int | None = None
    kv_cache_memory: str | None = None
    block_size: int = 16
    policy: str = "continuous"
    threads: int | None = None
    enable_prefix_caching: bool = True  # False: --no-enable-prefix-caching (every prompt computed in full)


@dataclass(frozen=True)
class Tuning:
    mode: str = "off"
    interval_seconds: int = 30
    window_seconds: int = 60
    bounds: dict[str, Bound] = field(default_factory=lambda: {name: Bound() for name in KNOB_NAMES})


@dataclass(frozen=True)
class Autoscaling:
    """spec.autoscaling: the operator sets the replicas between these bounds against the SLO."""

    min_replicas: int = 1
    max_replicas: int = 1
    scale_up_stabilization_seconds: int = 0
    scale_down_stabilization_seconds: int = 300


@dataclass(frozen=True)
class NetworkPolicy:
    enabled: bool = True
    api_from: tuple[dict, ...] = ()  # NetworkPolicyPeers allowed on the API port; () is anywhere


@dataclass(frozen=True)
class Router:
    """spec.router: an `iterserve router` Deployment in front of the pods, behind the Service `<name>`."""

    enabled: bool = False
    policy: str = "least-load"
    replicas: int = 1
    resources: dict = field(default_factory=dict)


@dataclass(frozen=True)
class SecretKeyRef:
    name: str
    key: str = "api-key"


@dataclass(frozen=True)
class LLMService:
    """The identity and validated spec of one LLMService."""

    name: str
    namespace: str
    uid: str
    generation: int
    model: ModelSource
    engine: Engine
    tuning: Tuning
    image: str = DEFAULT_IMAGE
    image_pull_policy: str | None = None
    image_pull_secrets: tuple[str, ...] = ()
    replicas: int = 1
    served_model_name: str | None = None
    max_queue: int | None = None
    resources: dict = field(default_factory=dict)
    node_selector: dict = field(default_factory=dict)
    tolerations: tuple = ()
    api_key: SecretKeyRef | None = None
    ttft_p99_ms: float | None = None
    itl_p99_ms: float | None = None
    drain_timeout_seconds: int = 30
    network_policy: NetworkPolicy = NetworkPolicy()
    autoscaling: Autoscaling | None = None  # None: replicas are spec.replicas (or an HPA's, through /scale)
    router: Router = field(default_factory=Router)


class _Reader:
    """Typed reads of a nested dict that collect every error with its field path."""

    def __init__(self) -> None:
        self.errors: list[tuple[str, str]] = []

    def error(self, path: str, message: str) -> None:
        self.errors.append((path, message))

    def obj(self, parent: dict, key: str, path: str) -> dict:
        value = parent.get(key)
        if value is None:
            return {}
        if not isinstance(value, dict):
            self.error(f"{path}.{key}", f"must be an object, got {type(value).__name__}")
            return {}
        return value

    def integer(self, parent: dict, key: str, path: str, default: int | None, lo: int = 1, hi: int = KNOB_LIMIT):
        value = parent.get(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            self.error(f"{path}.{key}", f"must be an integer, got {value!r}")
            return default
        if not lo <= value <= hi:
            self.error(f"{path}.{key}", f"must be in [{lo}, {hi}], got {value}")
            return default
        return value

    def number(self, parent: dict, key: str, path: str, lo: float, hi: float) -> float | None:
        value = parent.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
            self.error(f"{path}.{key}", f"must be a number in [{lo:g}, {hi:g}], got {value!r}")
            return None
        return float(value)

    def boolean(self, parent: dict, key: str, path: str, default: bool) -> bool:
        value = parent.get(key, default)
        if not isinstance(value, bool):
            self.error(f"{path}.{key}", f"must be true or false, got {value!r}")
            return default
        return value

    def string(self, parent: dict, key: str, path: str, default: str | None = None, choices=None):
        value = parent.get(key, default)
        if value is None:
            return None
        if not isinstance(value, str) or not value:
            self.error(f"{path}.{key}", f"must be a non-empty string, got {value!r}")
            return default
        if choices is not None and value not in choices:
            self.error(f"{path}.{key}", f"must be one of {', '.join(choices)}, got {value!r}")
            return default
        return value


def parse_llmservice(body: dict[str, Any]) -> LLMService:
    """Read an LLMService object (as the API returns it) into `LLMService`; raise SpecError naming each bad field."""
    meta = body.get("metadata") or {}
    r = _Reader()
    spec = r.obj(body, "spec", "")  # path "" + ".spec" -> ".spec"; trimmed below
    p = "spec"
    model = _parse_model(r, r.obj(spec, "model", p), f"{p}.model")
    tuning = _parse_tuning(r, r.obj(spec, "tuning", p), f"{p}.tuning")
    engine = _parse_engine(r, r.obj(spec, "engine", p), f"{p}.engine", tuning)
    slo = r.obj(spec, "slo", p)
    api_key = None
    if spec.get("apiKeySecretRef") is not None:
        ref = r.obj(spec, "apiKeySecretRef", p)
        api_key = SecretKeyRef(name=r.string(ref, "name", f"{p}.apiKeySecretRef") or "",
                               key=r.string(ref, "key", f"{p}.apiKeySecretRef", "api-key"))
        if not api_key.name:
            r.error(f"{p}.apiKeySecretRef.name", "required")
    service = LLMService(
        name=meta.get("name", ""),
        namespace=meta.get("namespace", ""),
        uid=meta.get("uid", ""),
        generation=int(meta.get("generation") or 0),
        model=model,
        engine=engine,
        tuning=tuning,
        image=r.string(spec, "image", p, DEFAULT_IMAGE),
        image_pull_policy=r.string(spec, "imagePullPolicy", p, None, PULL_POLICIES),
        image_pull_secrets=tuple(s.get("name", "") for s in _list(r, spec, "imagePullSecrets", p)),
        replicas=r.integer(spec, "replicas", p, 1, lo=0, hi=1000),
        served_model_name=r.string(spec, "servedModelName", p),
        max_queue=r.integer(spec, "maxQueue", p, None, hi=2**31 - 1),
        resources=r.obj(spec, "resources", p),
        node_selector=r.obj(spec, "nodeSelector", p),
        tolerations=tuple(_list(r, spec, "tolerations", p)),
        api_key=api_key,
        ttft_p99_ms=r.number(slo, "ttftP99Ms", f"{p}.slo", 1, 3_600_000),
        itl_p99_ms=r.number(slo, "itlP99Ms", f"{p}.slo", 1, 600_000),
        drain_timeout_seconds=r.integer(spec, "drainTimeoutSeconds", p, 30, lo=0, hi=3600),
        network_policy=_parse_network_policy(r, r.obj(spec, "networkPolicy", p), f"{p}.networkPolicy"),
        autoscaling=_parse_autoscaling(r, spec, p),
        router=_parse_router(r, r.obj(spec, "router", p), f"{p}.router"),
    )
    _check_cross_field(r, service)
    if r.errors:
        raise SpecError([(path.removeprefix("."), message) for path, message in r.errors])
    return service


def _list(r: _Reader, parent: dict, key: str, path: str) -> list:
    value = parent.get(key) or []
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        r.error(f"{path}.{key}", "must be a list of objects")
        return []
    return value


def _parse_model(r: _Reader, model: dict, p: str) -> ModelSource:
    return ModelSource(source=r.string(model, "source", p, "default", MODEL_SOURCES),
                       path=r.string(model, "path", p), pvc_name=r.string(model, "pvcName", p))


def _parse_engine(r: _Reader, engine: dict, p: str, tuning: Tuning) -> Engine:
    knobs = {name: r.integer(engine, camel(name), p, initial_knob(name, tuning)) for name in DEFAULT_KNOBS}
    return Engine(
        knobs=knobs,
        dtype=r.string(engine, "dtype", p, "auto", DTYPES),
        max_model_len=r.integer(engine, "maxModelLen", p, None),
        kv_cache_memory=r.string(engine, "kvCacheMemory", p),
        block_size=r.integer(engine, "blockSize", p, 16, hi=1024),
        policy=r.string(engine, "policy", p, "continuous", POLICIES),
        threads=r.integer(engine, "threads", p, None, hi=1024),
        enable_prefix_caching=r.boolean(engine, "enablePrefixCaching", p, True),
    )


def initial_knob(name: str, tuning: Tuning) -> int:
    """A knob the spec leaves out starts at its default, moved into the tuner's bounds when tuning is auto
    (bounds written for older, smaller defaults stay valid); one written outside them is an error."""
    default = DEFAULT_KNOBS[name]
    if tuning.mode != "auto":
        return default
    bound = tuning.bounds[name]
    return max(bound.min, min(default, bound.max))


def _parse_tuning(r: _Reader, tuning: dict, p: str) -> Tuning:
    bounds_spec = r.obj(tuning, "bounds", p)
    bounds = {}
    for name in KNOB_NAMES:
        bound = r.obj(bounds_spec, camel(name), f"{p}.bounds")
        path = f"{p}.bounds.{camel(name)}"
        bounds[name] = Bound(min=r.integer(bound, "min", path, 1), max=r.integer(bound, "max", path, KNOB_LIMIT))
    return Tuning(
        mode=r.string(tuning, "mode", p, "off", TUNING_MODES),
        interval_seconds=r.integer(tuning, "intervalSeconds", p, 30, lo=5, hi=3600),
        window_seconds=r.integer(tuning, "windowSeconds", p, 60, lo=10, hi=86400),
        bounds=bounds,
    )


def _parse_autoscaling(r: _Reader, spec: dict, p: str) -> Autoscaling | None:
    if spec.get("autoscaling") is None:
        return None
    a, p = r.obj(spec, "autoscaling", p), f"{p}.autoscaling"
    if a.get("maxReplicas") is None:
        r.error(f"{p}.maxReplicas", "required")
    return Autoscaling(
        min_replicas=r.integer(a, "minReplicas", p, 1, lo=1, hi=1000),
        max_replicas=r.integer(a, "maxReplicas", p, 1, lo=1, hi=1000),
        scale_up_stabilization_seconds=r.integer(a, "scaleUpStabilizationSeconds", p, 0, lo=0, hi=3600),
        scale_down_stabilization_seconds=r.integer(a, "scaleDownStabilizationSeconds", p, 300, lo=0, hi=3600),
    )


def _parse_router(r: _Reader, router: dict, p: str) -> Router:
    return Router(enabled=r.boolean(router, "enabled", p, False),
                  policy=r.string(router, "policy", p, "least-load", ROUTER_POLICIES),
                  replicas=r.integer(router, "replicas", p, 1, lo=1, hi=100),
                  resources=r.obj(router, "resources", p))


def _parse_network_policy(r: _Reader, policy: dict, p: str) -> NetworkPolicy:
    peers = tuple(_list(r, policy, "apiFrom", p))
    for i, peer in enumerate(peers):
        # the API server would refuse the NetworkPolicy for these; said here, against the field
        if not peer.keys() & {"podSelector", "namespaceSelector", "ipBlock"}:
            r.error(f"{p}.apiFrom[{i}]", "must set podSelector, namespaceSelector or ipBlock")
        elif "ipBlock" in peer and peer.keys() & {"podSelector", "namespaceSelector"}:
            r.error(f"{p}.apiFrom[{i}].ipBlock", "may not be combined with podSelector or namespaceSelector")
    return NetworkPolicy(enabled=r.boolean(policy, "enabled", p, True), api_from=peers)


def _check_cross_field(r: _Reader, s: LLMService) -> None:
    """The rules a structural schema cannot express (Kubernetes 1.20 has no CEL)."""
    m = s.model
    if m.source == "path" and not m.path:
        r.error("spec.model.path", "required when source is path")
    if m.source == "path" and m.path and not m.path.startswith("/"):
        r.error("spec.model.path", f"must be an absolute path in the image, got {m.path!r}")
    if m.source == "pvc" and not m.pvc_name:
        r.error("spec.model.pvcName", "required when source is pvc")
    if m.source != "pvc" and m.pvc_name:
        r.error("spec.model.pvcName", f"only used when source is pvc, not {m.source}")
    if m.source == "default" and m.path:
        r.error("spec.model.path", "not used when source is default (the bundled model)")
    if m.source == "pvc" and m.path and (m.path.startswith("/") or ".." in m.path.split("/")):
        r.error("spec.model.path", f"must be a relative path inside the claim, got {m.path!r}")
    for name, bound in s.tuning.bounds.items():
        if bound.min > bound.max:
            r.error(f"spec.tuning.bounds.{camel(name)}", f"min {bound.min} is above max {bound.max}")
        elif s.tuning.mode == "auto" and not bound.min <= s.engine.knobs[name] <= bound.max:
            r.error(f"spec.engine.{camel(name)}", f"must be within spec.tuning.bounds.{camel(name)} "
                    f"[{bound.min}, {bound.max}] when tuning is auto, got {s.engine.knobs[name]}")
    if s.tuning.mode == "auto" and s.ttft_p99_ms is None and s.itl_p99_ms is None:
        r.error("spec.slo", "give ttftP99Ms and/or itlP99Ms: tuning mode auto tunes against them")
    if s.tuning.window_seconds < s.tuning.interval_seconds:
        r.error("spec.tuning.windowSeconds",
                f"must be >= intervalSeconds ({s.tuning.interval_seconds}), got {s.tuning.window_seconds}")
    if s.autoscaling is not None:
        _check_autoscaling(r, s)
    if s.engine.max_model_len is not None and s.engine.block_size > s.engine.max_model_len:
        r.error("spec.engine.blockSize", f"must not exceed maxModelLen ({s.engine.max_model_len})")
    if s.api_key is not None and s.api_key.name == ADMIN_SECRET:
        r.error("spec.apiKeySecretRef.name", f"{ADMIN_SECRET} is the operator's admin-token Secret")
    for i, toleration in enumerate(s.tolerations):
        if toleration.get("operator") == "Exists" and toleration.get("value"):
            r.error(f"spec.tolerations[{i}].value", "must be empty when operator is Exists")


def _check_autoscaling(r: _Reader, s: LLMService) -> None:
    a = s.autoscaling
    assert a is not None  # checked only when given
    if a.min_replicas > a.max_replicas:
        r.error("spec.autoscaling.minReplicas", f"must not exceed maxReplicas ({a.max_replicas}), got {a.min_replicas}")
    if s.tuning.mode not in ("observe", "auto"):
        r.error("spec.tuning.mode", "must be observe or auto with spec.autoscaling: the tuner's windows are what "
                f"the replicas are scaled on, got {s.tuning.mode}")
    if s.tuning.mode != "auto" and s.ttft_p99_ms is None and s.itl_p99_ms is None:  # auto says it already
        r.error("spec.slo", "give ttftP99Ms and/or itlP99Ms: spec.autoscaling scales against them")
