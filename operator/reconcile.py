"""Bring an LLMService's children in line with its spec: plain functions over `Kube`, no kopf here.

Every step is idempotent and safe to run twice at once or to cut short (an operator killed mid-way,
two replicas for a moment): children have fixed names, so there is nothing to duplicate. The Secret
and the ConfigMap hold state (the admin token, the knobs in force) and are created with POST (a 409
means another run created it: use that one) and updated with the resourceVersion read (a 409 means
someone wrote in between: read again). The Deployments, Services, PodDisruptionBudget and
NetworkPolicies are pure renderings of the spec (and, for the Service's selector, of the router's
readiness) and go through server-side apply, which creates them when missing and puts back any field
someone else changed.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import defaultdict
from dataclasses import dataclass, field

from kubernetes.client.exceptions import ApiException

from iterserve.operator.builders.configmap import build_knobs_configmap, knobs_from_configmap, spec_knobs_recorded
from iterserve.operator.builders.deployment import TOKEN_DIGEST_ANNOTATION, build_deployment
from iterserve.operator.builders.labels import (
    ADMIN_PORT_NAME,
    HTTP_PORT,
    IN_ROTATION,
    ROTATION_LABEL,
    knobs_configmap_name,
    pods_service_name,
    router_name,
    selector_labels,
    selector_string,
)
from iterserve.operator.builders.networkpolicy import API_VERSION as NETWORK_POLICY_API
from iterserve.operator.builders.networkpolicy import OperatorPeer, build_network_policy, build_router_network_policy
from iterserve.operator.builders.pdb import build_pdb
from iterserve.operator.builders.router import build_pods_service, build_router_deployment
from iterserve.operator.builders.secret import (
    ADMIN_SECRET,
    admin_secret_patch,
    admin_token_of,
    build_admin_secret,
    new_admin_token,
    token_digest,
)
from iterserve.operator.builders.service import build_service
from iterserve.operator.drift import apply_needed, differences, foreign_owner, with_applied_digest
from iterserve.operator.knob_plan import KnobPlan, describe_change, plan_knobs
from iterserve.operator.kube import Kube, is_status
from iterserve.operator.pod_rotation import ensure_rotation_labels
from iterserve.operator.spec import LLMService
from iterserve.operator.tuning.pod_admin import PodCallError, get_scheduler, patch_scheduler

logger = logging.getLogger("iterserve.operator")
MAX_CONFLICT_RETRIES = 5


@dataclass(frozen=True)
class Change:
    kind: str
    name: str
    action: str  # created, updated, deleted, live
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.kind} {self.name} {self.action}" + (f": {self.detail}" if self.detail else "")


@dataclass
class Outcome:
    changes: list[Change] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    knobs: dict[str, int] | None = None
    deployment: dict | None = None
    router: dict | None = None  # the router's Deployment as applied (spec.router on)


class ChildConflict(Exception):
    """A child's name is taken by an object the operator does not manage."""


def _check_ours(obj: dict | None, svc: LLMService) -> None:
    if obj is not None:
        reason = foreign_owner(obj, svc.uid)
        if reason is not None:
            raise ChildConflict(f"{obj['kind']} {svc.namespace}/{obj['metadata']['name']}: {reason}; "
                                f"rename the LLMService or remove that object")


def _metadata_patch(desired: dict, current: dict) -> dict:
    meta = desired["metadata"]
    patch = {"resourceVersion": current["metadata"]["resourceVersion"], "labels": meta["labels"],
             "ownerReferences": meta["ownerReferences"]}
    if "annotations" in meta:
        patch["annotations"] = meta["annotations"]
    return patch


def ensure_admin_secret(kube: Kube, svc: LLMService, out: Outcome) -> str:
    """svc's admin token: the stored one when there is one (pods were started with it), else a new one,
    in the namespace's admin Secret (builders/secret.py)."""
    current = kube.get("v1", "Secret", svc.namespace, ADMIN_SECRET)
    _check_ours(current, svc)
    token = admin_token_of(current, svc.name)
    if current is not None and token is not None and admin_secret_patch(current, svc, token) is None:
        return token  # most passes: nothing to write, and no turn to wait for
    # Every LLMService of the namespace writes this one Secret: created together (a fleet applied at once),
    # their passes would make each other's resourceVersion stale and run out of retries. Within this
    # process they take turns; a writer elsewhere still gets a 409 and a fresh read.
    with _secret_writers(svc.namespace):
        return _write_admin_secret(kube, svc, out)


_secret_locks: dict[str, threading.Lock] = defaultdict(threading.Lock)
_secret_locks_guard = threading.Lock()


def _secret_writers(namespace: str) -> threading.Lock:
    with _secret_locks_guard:
        return _secret_locks[namespace]


def _write_admin_secret(kube: Kube, svc: LLMService, out: Outcome) -> str:
    for _ in range(MAX_CONFLICT_RETRIES):
        current = kube.get("v1", "Secret", svc.namespace, ADMIN_SECRET)
        _check_ours(current, svc)
        token = admin_token_of(current, svc.name) or new_admin_token()
        try:
            if current is None:
                kube.create(build_admin_secret(svc, token))
                out.changes.append(Change("Secret", ADMIN_SECRET, "created", f"admin token of {svc.name}"))
                return token
            patch = admin_secret_patch(current, svc, token)
            if patch is None:
                return token
            kube.merge_patch("v1", "Secret", svc.namespace, ADMIN_SECRET, patch)
        except ApiException as e:
            if is_status(e, 409):
                continue  # created or written by another writer in between: read again
            raise
        written = admin_token_of({"data": patch.get("data") or {}}, svc.name)
        out.changes.append(Change("Secret", ADMIN_SECRET, "updated", f"new admin token of {svc.name}" if written
                                  else "owners, labels or keys of deleted services"))
        return written or token
    raise RuntimeError(f"Secret {ADMIN_SECRET}: still conflicting after {MAX_CONFLICT_RETRIES} tries")


def ensure_knobs(kube: Kube, svc: LLMService, out: Outcome) -> dict[str, int]:
    """Write the knobs to have in force (operator/knob_plan.py decides) into ConfigMap <name>-knobs."""
    return _write_knobs(kube, svc, out, lambda current: plan_knobs(svc, current), keep_recorded=False)


def set_tuned_knobs(kube: Kube, svc: LLMService, knobs: dict[str, int]) -> None:
    """For the tuner (its `apply_knobs`): put `knobs` in force in ConfigMap <name>-knobs, so that new pods
    start with them. Keeps the recorded spec knobs, so a spec edit not yet reconciled is still seen as
    one. Raises ApiException or RuntimeError when the write did not happen."""
    _write_knobs(kube, svc, Outcome(), lambda current: KnobPlan(dict(knobs), "tuner"), keep_recorded=True)


def _write_knobs(kube: Kube, svc: LLMService, out: Outcome, choose, *, keep_recorded: bool) -> dict[str, int]:
    name = knobs_configmap_name(svc.name)
    for _ in range(MAX_CONFLICT_RETRIES):
        current = kube.get("v1", "ConfigMap", svc.namespace, name)
        _check_ours(current, svc)
        plan = choose(current)
        recorded = spec_knobs_recorded(current) if keep_recorded else None
        desired = build_knobs_configmap(svc, plan.knobs, recorded or svc.engine.knobs)
        try:
            if current is None:
                kube.create(desired)
                out.changes.append(Change("ConfigMap", name, "created", describe_change(None, plan.knobs)))
                return plan.knobs
            drift = differences({"metadata": {k: desired["metadata"][k] for k in
                                              ("labels", "annotations", "ownerReferences")},
                                 "data": desired["data"]}, current)
            if drift:
                kube.merge_patch("v1", "ConfigMap", svc.namespace, name,
                                 {"metadata": _metadata_patch(desired, current), "data": desired["data"]})
                detail = (f"{describe_change(knobs_from_configmap(current), plan.knobs)} ({plan.reason})"
                          if plan.reason else ", ".join(drift))
                out.changes.append(Change("ConfigMap", name, "updated", detail))
            return plan.knobs
        except ApiException as e:
            if is_status(e, 409):
                continue  # created or written by another run (or the tuner) in between: plan again
            raise
    raise RuntimeError(f"ConfigMap {name}: still conflicting after {MAX_CONFLICT_RETRIES} tries")


def apply_child(kube: Kube, svc: LLMService, desired: dict, out: Outcome) -> dict:
    """Server-side apply of a rendered child; records created/updated (with the drifted fields). Skipped
    when the child as stored already holds every field of this rendering and was last applied from it
    (drift.apply_needed): most passes change nothing, and each apply is a write the API server stores.
    The child as stored comes from the watch-fed cache when it has it and it shows no drift, else a GET."""
    meta = desired["metadata"]
    stamped = with_applied_digest(desired)
    current = kube.cached(desired["kind"], meta["namespace"], meta["name"])
    if current is None or apply_needed(stamped, current):  # no entry, or drift a lagging watch may show
        current = kube.get(desired["apiVersion"], desired["kind"], meta["namespace"], meta["name"])
    _check_ours(current, svc)
    if current is not None and not apply_needed(stamped, current):
        return current
    applied = kube.apply(stamped)
    if current is None:
        out.changes.append(Change(desired["kind"], meta["name"], "created"))
    elif applied["metadata"]["resourceVersion"] != current["metadata"]["resourceVersion"]:
        # the fields that drifted or changed; none when only fields the rendering dropped went away
        drift = apply_needed(desired, current) or ["the rendering (a field dropped, or no digest yet)"]
        out.changes.append(Change(desired["kind"], meta["name"], "updated", ", ".join(drift)))
    return applied


def ensure_optional(kube: Kube, svc: LLMService, api_version: str, kind: str, desired: dict | None, why_not: str,
                    out: Outcome, name: str | None = None) -> dict | None:
    """A child the spec may do without (`desired` None): applied (and returned) when wanted, else ours,
    `name` (default the LLMService's), is deleted. Its absence from a listed watch (child_cache.py) spares
    the GET that would find nothing to delete: the router's three children while it is off, the PDB at
    one replica."""
    if desired is not None:
        return apply_child(kube, svc, desired, out)
    name = name or svc.name
    if kube.known_absent(kind, svc.namespace, name):
        return None  # the watch has listed the namespace and holds none of ours: nothing to delete
    current = kube.get(api_version, kind, svc.namespace, name)
    if current is not None and foreign_owner(current, svc.uid) is None:
        if kube.delete(api_version, kind, svc.namespace, name):
            out.changes.append(Change(kind, name, "deleted", why_not))
    return None


def ensure_pdb(kube: Kube, svc: LLMService, out: Outcome) -> None:
    version = kube.pdb_api_version
    ensure_optional(kube, svc, version, "PodDisruptionBudget", build_pdb(svc, version), "replicas <= 1", out)


def ensure_network_policy(kube: Kube, svc: LLMService, operator: OperatorPeer, out: Outcome) -> None:
    ensure_optional(kube, svc, NETWORK_POLICY_API, "NetworkPolicy", build_network_policy(svc, operator),
                    "spec.networkPolicy.enabled is false", out)


def ensure_router(kube: Kube, svc: LLMService, out: Outcome) -> dict | None:
    """spec.router's children (builders/router.py): applied when on, returning the router's Deployment;
    deleted when off."""
    on, why_not, name = svc.router.enabled, "spec.router.enabled is false", svc.name
    ensure_optional(kube, svc, "v1", "Service", build_pods_service(svc) if on else None, why_not, out,
                    pods_service_name(name))
    ensure_optional(kube, svc, NETWORK_POLICY_API, "NetworkPolicy", build_router_network_policy(svc),
                    "no router or spec.networkPolicy.enabled is false", out, router_name(name))
    return ensure_optional(kube, svc, "apps/v1", "Deployment", build_router_deployment(svc) if on else None,
                           why_not, out, router_name(name))


def router_serving(router: dict | None) -> bool:
    """Whether the Service may send clients to the router: one of its pods is ready."""
    return ((router or {}).get("status") or {}).get("readyReplicas", 0) >= 1


def server_pods(kube: Kube, svc: LLMService) -> list[dict]:
    """Every pod of the service's Deployment, from the pod watch when it has listed, else a list."""
    pods = kube.cached_list("Pod", svc.namespace, selector_labels(svc.name))
    return pods if pods is not None else kube.list("v1", "Pod", svc.namespace, selector_string(svc.name))


def label_rotation(kube: Kube, svc: LLMService, out: Outcome) -> None:
    for name in ensure_rotation_labels(kube, svc, server_pods(kube, svc)):
        out.changes.append(Change("Pod", name, "updated", f"{ROTATION_LABEL}={IN_ROTATION}"))


def ready_pods(kube: Kube, svc: LLMService, token: str) -> list[dict]:
    """The service's pods that are Ready, have an IP and were started with admin token `token` (one
    started with an older token is being replaced by the rollout and would refuse it). From the pod
    watch when it has listed (a pod that turns Ready after the watch's last event gets the knobs from the
    next pass, as it would after a list), else a list."""
    digest = token_digest(token)
    return [pod for pod in server_pods(kube, svc)
            if not pod["metadata"].get("deletionTimestamp") and (pod.get("status") or {}).get("podIP")
            and (pod["metadata"].get("annotations") or {}).get(TOKEN_DIGEST_ANNOTATION) == digest
            and any(c.get("type") == "Ready" and c.get("status") == "True"
                    for c in (pod.get("status") or {}).get("conditions") or ())]


def pod_url(pod: dict) -> str:
    """The pod's API and /metrics."""
    return f"http://{pod['status']['podIP']}:{HTTP_PORT}"


def pod_admin_url(pod: dict) -> str:
    """The pod's admin API: its container port named `admin`, else (a pod from before the admin port,
    still running during the rollout that replaces it) the API port."""
    ports = {port.get("name"): port.get("containerPort") for container in pod["spec"].get("containers") or ()
             for port in container.get("ports") or ()}
    return f"http://{pod['status']['podIP']}:{ports.get(ADMIN_PORT_NAME) or HTTP_PORT}"


def sync_pod_knobs(kube: Kube, svc: LLMService, token: str, knobs: dict[str, int], out: Outcome,
                   timeout: float = 3.0) -> None:
    """Give every ready pod the knobs in force, live (GET to compare, PATCH what differs)."""
    for pod in ready_pods(kube, svc, token):
        pod_name = pod["metadata"]["name"]
        url = pod_admin_url(pod)
        try:
            running = get_scheduler(url, token, timeout).get("knobs") or {}
            different = {k: v for k, v in knobs.items() if running.get(k) != v}
            if different:
                patch_scheduler(url, token, different, timeout)
                out.changes.append(Change("Pod", pod_name, "live", describe_change(running, different)))
        except PodCallError as e:
            out.problems.append(f"pod {pod_name}: could not apply the knobs: {e}")


def reconcile(kube: Kube, svc: LLMService, *, pod_timeout: float = 3.0,
              operator: OperatorPeer = OperatorPeer()) -> Outcome:
    """One full pass. Every child is attempted even when another fails; failures land in `problems`."""
    out = Outcome()

    def attempt(what: str, step, *args):
        try:
            return step(*args)
        except (ApiException, ChildConflict, RuntimeError) as e:
            out.problems.append(f"{what}: {short_error(e)}")
            logger.warning("%s/%s: %s: %s", svc.namespace, svc.name, what, short_error(e))
            return None

    token = attempt("admin Secret", ensure_admin_secret, kube, svc, out)
    out.knobs = attempt("knobs ConfigMap", ensure_knobs, kube, svc, out)
    if token is not None:  # the pod template carries the token's digest
        out.deployment = attempt("Deployment", apply_child, kube, svc, build_deployment(svc, token_digest(token)), out)
    # the router before the Service that sends clients to it, and gone only after the Service left it
    if svc.router.enabled:
        out.router = attempt("router", ensure_router, kube, svc, out)
    attempt("pods' rotation", label_rotation, kube, svc, out)  # before the Service that selects by it
    service = attempt("Service", apply_child, kube, svc, build_service(svc, router_serving(out.router)), out)
    if not svc.router.enabled and service is not None:
        attempt("router", ensure_router, kube, svc, out)
    attempt("PodDisruptionBudget", ensure_pdb, kube, svc, out)
    attempt("NetworkPolicy", ensure_network_policy, kube, svc, operator, out)
    if token is not None and out.knobs is not None:
        attempt("pods", sync_pod_knobs, kube, svc, token, out.knobs, out, pod_timeout)
    return out


def short_error(error: BaseException) -> str:
    """One line for status and Events: the API server's message rather than the whole response."""
    if isinstance(error, ApiException):
        try:
            return f"HTTP {error.status}: {json.loads(error.body or '')['message']}"
        except (TypeError, ValueError, KeyError):
            return f"HTTP {error.status}: {error.reason}"
    return str(error)
