"""A thin dict-in, dict-out Kubernetes client for the few kinds the operator touches.

The builders produce plain dicts; the typed `kubernetes` models would only convert them back and
forth (and lose fields the models do not know). Requests go through the `kubernetes` package's
ApiClient (auth, TLS, kubeconfig); errors are its `ApiException` (`.status` 404, 409, ...).
"""

from __future__ import annotations

import functools
import json

from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException

from iterserve.operator.child_cache import ChildCache
from iterserve.operator.constants import GROUP, KIND, PLURAL, VERSION

FIELD_MANAGER = "iterserve-operator"
PLURALS = {
    "Deployment": "deployments", "Service": "services", "Secret": "secrets", "ConfigMap": "configmaps",
    "PodDisruptionBudget": "poddisruptionbudgets", "Pod": "pods", "Event": "events", "Lease": "leases",
    "ReplicaSet": "replicasets", "NetworkPolicy": "networkpolicies",
    "HorizontalPodAutoscaler": "horizontalpodautoscalers",
    KIND: PLURAL,
}
MERGE_PATCH = "application/merge-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"  # server-side apply; JSON is YAML


def path_of(api_version: str, kind: str, namespace: str, name: str | None = None,
            subresource: str | None = None) -> str:
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    path = f"{base}/namespaces/{namespace}/{PLURALS[kind]}"
    if name is not None:
        path += f"/{name}"
    if subresource is not None:
        path += f"/{subresource}"
    return path


def is_status(error: BaseException, *codes: int) -> bool:
    return isinstance(error, ApiException) and error.status in codes


class Kube:
    def __init__(self, api_client: ApiClient, timeout: float = 30.0):
        self.api_client = api_client
        self.timeout = timeout
        # kind -> the objects a watch feeds (operator/child_cache.py); empty where nothing watches them
        self.caches: dict[str, ChildCache] = {}

    def cached(self, kind: str, namespace: str, name: str) -> dict | None:
        """The object as a watch last delivered it, a hint only (child_cache.py); None: ask the server."""
        cache = self.caches.get(kind)
        return None if cache is None else cache.get(namespace, name)

    def cached_list(self, kind: str, namespace: str, labels: dict[str, str]) -> list[dict] | None:
        """The watched objects of `namespace` with `labels`; None: no watch has listed it, ask the server."""
        cache = self.caches.get(kind)
        return None if cache is None else cache.select(namespace, labels)

    def known_absent(self, kind: str, namespace: str, name: str) -> bool:
        """Whether a watch that has listed the namespace holds no such object of ours (child_cache.py)."""
        cache = self.caches.get(kind)
        return cache is not None and cache.absent(namespace, name)

    def _send(self, method: str, path: str, body, query: list | None, content_type: str, timeout):
        client = self.api_client
        request = client.param_serialize(
            method, path, query_params=query or [], body=body, auth_settings=["BearerToken"],
            header_params={"Accept": "application/json", "Content-Type": content_type})
        response = client.call_api(*request, _request_timeout=timeout)
        if not 200 <= response.status <= 299:
            response.read()
            raise ApiException(http_resp=response)
        return response

    def request(self, method: str, path: str, body=None, *, query: list | None = None,
                content_type: str = "application/json") -> dict:
        response = self._send(method, path, body, query, content_type, self.timeout)
        response.read()
        return json.loads(response.data) if response.data else {}

    def stream(self, method: str, path: str, *, query: list | None = None, read_timeout: float):
        """The response (urllib3's) unread, for a watch: the caller reads it as it comes, then releases it."""
        return self._send(method, path, None, query, "application/json", (self.timeout, read_timeout)).response

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict | None:
        try:
            return self.request("GET", path_of(api_version, kind, namespace, name))
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def list(self, api_version: str, kind: str, namespace: str, label_selector: str | None = None) -> list[dict]:
        query = [("labelSelector", label_selector)] if label_selector else []
        return self.request("GET", path_of(api_version, kind, namespace), query=query).get("items") or []

    def create(self, obj: dict) -> dict:
        meta = obj["metadata"]
        return self.request("POST", path_of(obj["apiVersion"], obj["kind"], meta["namespace"]), obj)

    def apply(self, obj: dict) -> dict:
        """Server-side apply as the operator's field manager, taking over fields others changed (drift)."""
        meta = obj["metadata"]
        return self.request("PATCH", path_of(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"]), obj,
                            query=[("fieldManager", FIELD_MANAGER), ("force", "true")], content_type=APPLY_PATCH)

    def merge_patch(self, api_version: str, kind: str, namespace: str, name: str, patch: dict,
                    subresource: str | None = None) -> dict:
        return self.request("PATCH", path_of(api_version, kind, namespace, name, subresource), patch,
                            query=[("fieldManager", FIELD_MANAGER)], content_type=MERGE_PATCH)

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> bool:
        """True when this call deleted it, False when it was already gone."""
        try:
            self.request("DELETE", path_of(api_version, kind, namespace, name))
            return True
        except ApiException as e:
            if e.status == 404:
                return False
            raise

    def serves(self, api_version: str) -> bool:
        """Whether the server serves this group/version (e.g. policy/v1 exists from Kubernetes 1.21)."""
        try:
            self.request("GET", f"/apis/{api_version}")
            return True
        except ApiException as e:
            if e.status == 404:
                return False
            raise

    @functools.cached_property
    def pdb_api_version(self) -> str:
        """policy/v1 where served (Kubernetes >= 1.21), else policy/v1beta1: the same PodDisruptionBudget."""
        return "policy/v1" if self.serves("policy/v1") else "policy/v1beta1"

    def get_llmservice(self, namespace: str, name: str) -> dict | None:
        return self.get(f"{GROUP}/{VERSION}", KIND, namespace, name)
