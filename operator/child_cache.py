"""The operator's children as its watches last delivered them, so a pass need not GET each one.

A label-selected watch per kind (operator/child_watch.py: Deployments, Services, NetworkPolicies,
PodDisruptionBudgets and pods that carry our managed-by label) lists them, then feeds every change in
here; an object whose label was taken away leaves the cache rather than stand in it unchanged. A reader
treats an entry as a hint, never as the truth:
- an entry that shows no drift lets a pass skip the GET and the apply; one that shows drift, or no
  entry, sends the pass to the API server (reconcile.apply_child). A lagging watch costs a GET.
- `absent` (the scope's listing is in and the watch has no entry) lets a pass skip the GET that would
  only find nothing to delete (a PodDisruptionBudget at 1 replica, the router's children with the router
  off). It never stands in for a read before a write: a name taken by an object without our label is not
  in the cache, so applies still GET first (reconcile._check_ours).
A drift, or a child of ours, that lands after the pass read the cache is acted on by the next pass (the
resync timer), as it would have been had it landed after a GET: the watch delivers it by then.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from iterserve.operator.builders.labels import MANAGED_BY, MANAGED_BY_LABEL

CLUSTER = None  # the scope of a watch over every namespace


class ChildCache:
    """Objects of one kind by (namespace, name), fed by watch events. Thread-safe; entries are replaced,
    never changed in place, so a reader may keep the dict it got."""

    def __init__(self, kind: str):
        self.kind = kind
        self._objects: dict[tuple[str, str], dict] = {}
        self._synced: set[str | None] = set()  # scopes (a namespace, or CLUSTER) whose listing is in
        self._lock = threading.Lock()

    def observe(self, event_type: str | None, obj: dict) -> None:
        """One watch event (None for an object of a listing, ADDED, MODIFIED, DELETED) and its object."""
        meta = obj.get("metadata") or {}
        key = (meta.get("namespace", ""), meta.get("name", ""))
        ours = (meta.get("labels") or {}).get(MANAGED_BY_LABEL) == MANAGED_BY
        with self._lock:
            if event_type == "DELETED" or not ours or meta.get("deletionTimestamp"):
                self._objects.pop(key, None)
            else:
                self._objects[key] = obj

    def replace(self, scope: str | None, objects: Iterable[dict]) -> None:
        """A full listing of `scope` (a namespace, or CLUSTER for all): what it lacks is gone, and from now
        on a missing entry there means no such object of ours (`absent`)."""
        with self._lock:
            self._objects = {key: obj for key, obj in self._objects.items()
                             if scope is not CLUSTER and key[0] != scope}
        for obj in objects:
            self.observe(None, obj)
        with self._lock:
            self._synced.add(scope)

    def unsync(self, scope: str | None) -> None:
        """The watch of `scope` broke off: until it lists again, a missing entry proves nothing."""
        with self._lock:
            self._synced.discard(scope)

    def get(self, namespace: str, name: str) -> dict | None:
        """The object as last seen, or None when the watch has not delivered it (or it is gone)."""
        with self._lock:
            return self._objects.get((namespace, name))

    def absent(self, namespace: str, name: str) -> bool:
        """True when the watch over `namespace` has listed and holds no such object of ours."""
        with self._lock:
            synced = CLUSTER in self._synced or namespace in self._synced
            return synced and (namespace, name) not in self._objects

    def select(self, namespace: str, labels: dict[str, str]) -> list[dict] | None:
        """The objects in `namespace` carrying every label in `labels`, or None before the listing is in."""
        with self._lock:
            if CLUSTER not in self._synced and namespace not in self._synced:
                return None
            return [obj for (ns, _), obj in self._objects.items() if ns == namespace
                    and all(((obj["metadata"].get("labels") or {}).get(k)) == v for k, v in labels.items())]

    def __len__(self) -> int:
        with self._lock:
            return len(self._objects)
