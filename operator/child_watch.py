"""Label-selected list-and-watch of the operator's children, feeding operator/child_cache.py.

One thread per kind and scope (every namespace, or each namespace the operator watches) lists the
objects carrying our managed-by label, then watches from the listing's resourceVersion. The label
selector is applied by the API server: the operator neither receives nor holds the cluster's other
Services or pods (kopf's watches filter on the client, after receiving everything). A watch that the
server ends (its timeout) resumes from the last resourceVersion; an expired one (410) or any error
lists again after a pause, the scope counting as not listed (`ChildCache.unsync`) until it has.
Secrets are not watched: the operator reads one Secret per namespace by name and holds no right to
list Secrets.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass

from kubernetes.client.exceptions import ApiException

from iterserve.operator.builders.labels import MANAGED_BY, MANAGED_BY_LABEL
from iterserve.operator.builders.networkpolicy import API_VERSION as NETWORK_POLICY_API
from iterserve.operator.child_cache import CLUSTER, ChildCache
from iterserve.operator.kube import PLURALS, Kube

logger = logging.getLogger("iterserve.operator")
SELECTOR = f"{MANAGED_BY_LABEL}={MANAGED_BY}"
WATCH_SECONDS = 300  # the server ends each watch after this long; it resumes from where it was
RETRY_SECONDS = 2.0


@dataclass(frozen=True)
class Watched:
    kind: str
    api_version: str


def watched_kinds(pdb_api_version: str) -> list[Watched]:
    """The children a pass reads: every rendered kind, and the server pods it gives knobs to."""
    return [Watched("Deployment", "apps/v1"), Watched("Service", "v1"),
            Watched("NetworkPolicy", NETWORK_POLICY_API), Watched("PodDisruptionBudget", pdb_api_version),
            Watched("Pod", "v1")]


def collection_path(api_version: str, kind: str, scope: str | None) -> str:
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    where = "" if scope is CLUSTER else f"/namespaces/{scope}"
    return f"{base}{where}/{PLURALS[kind]}"


class ChildWatch(threading.Thread):
    """Keeps `cache` in step with one kind's labelled objects in one scope until `stop()`."""

    def __init__(self, kube: Kube, watched: Watched, cache: ChildCache, scope: str | None):
        super().__init__(name=f"watch-{watched.kind}-{scope or 'all'}", daemon=True)
        self.kube, self.watched, self.cache, self.scope = kube, watched, cache, scope
        self.path = collection_path(watched.api_version, watched.kind, scope)
        self._stopping = threading.Event()
        self._response = None

    def run(self) -> None:
        version = None
        while not self._stopping.is_set():
            try:
                if version is None:
                    version = self._list()
                version = self._watch(version)
            except Exception as e:  # the API server gone, a 410, a broken stream: list again
                if self._stopping.is_set():
                    return
                self.cache.unsync(self.scope)
                version = None
                logger.warning("watch of %s (%s): %s; listing again in %.0f s", self.watched.kind,
                               self.scope or "all namespaces", e, RETRY_SECONDS)
                self._stopping.wait(RETRY_SECONDS)

    def stop(self) -> None:
        self._stopping.set()
        response = self._response
        if response is not None:
            response.shutdown()  # wakes the read of a watch that has nothing to say

    def _list(self) -> str:
        listing = self.kube.request("GET", self.path, query=[("labelSelector", SELECTOR)])
        self.cache.replace(self.scope, [self._typed(obj) for obj in listing.get("items") or ()])
        return listing["metadata"]["resourceVersion"]

    def _typed(self, obj: dict) -> dict:
        # a listing's items carry no kind; the readers compare them with renderings that do
        return {"apiVersion": self.watched.api_version, "kind": self.watched.kind, **obj}

    def _watch(self, version: str) -> str:
        """One watch from `version` until the server ends it; the last resourceVersion seen."""
        response = self.kube.stream("GET", self.path, query=[
            ("labelSelector", SELECTOR), ("watch", "true"), ("resourceVersion", version),
            ("allowWatchBookmarks", "true"), ("timeoutSeconds", str(WATCH_SECONDS))],
            read_timeout=WATCH_SECONDS + 30)
        self._response = response
        try:
            for line in _lines(response):
                event = json.loads(line)
                obj = event.get("object") or {}
                if event.get("type") == "ERROR":  # e.g. 410: the version is too old to resume from
                    raise ApiException(status=obj.get("code"), reason=obj.get("message"))
                version = (obj.get("metadata") or {}).get("resourceVersion") or version
                if event.get("type") != "BOOKMARK":
                    self.cache.observe(event.get("type"), obj)
        finally:
            self._response = None
            response.release_conn()
        return version


def _lines(response):
    """The newline-separated JSON events of a watch response, as they arrive."""
    pending = b""
    for chunk in response.stream(64 * 1024, decode_content=True):
        pending += chunk
        *lines, pending = pending.split(b"\n")
        yield from (line for line in lines if line.strip())
    if pending.strip():
        yield pending


def start_child_watches(kube: Kube, namespaces: list[str]) -> list[ChildWatch]:
    """A watch per watched kind and scope (every namespace when `namespaces` is empty), each feeding
    `kube.caches[kind]`."""
    watches = []
    for watched in watched_kinds(kube.pdb_api_version):
        cache = kube.caches.setdefault(watched.kind, ChildCache(watched.kind))
        scopes: list[str | None] = list(namespaces) or [CLUSTER]
        for scope in scopes:
            watch = ChildWatch(kube, watched, cache, scope)
            watch.start()
            watches.append(watch)
    return watches
