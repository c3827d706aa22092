"""The operator's Deployments as its watch last delivered them, so a pass need not GET each one.

kopf already watches Deployments (handlers.py: the status refresh and the deleted-child repair); an event
handler feeds every one that carries our managed-by label in here and drops the rest, so one whose label
was taken away leaves the cache rather than stand in it unchanged. A reader treats an entry as a hint,
never as the truth: an entry that shows no drift lets a pass skip the GET and the apply; one that shows
drift, or no entry, sends the pass to the API server (reconcile.apply_child). So a lagging watch costs a
GET, and a drift that lands after the pass read its entry is repaired by the next pass (the resync timer),
as it would have been without the cache.
"""

from __future__ import annotations

import threading

from iterserve.operator.builders.labels import MANAGED_BY, MANAGED_BY_LABEL


class ChildCache:
    """Objects of one kind by (namespace, name), fed by watch events. Thread-safe; entries are replaced,
    never changed in place, so a reader may keep the dict it got."""

    def __init__(self, kind: str):
        self.kind = kind
        self._objects: dict[tuple[str, str], dict] = {}
        self._lock = threading.Lock()

    def observe(self, event_type: str | None, obj: dict) -> None:
        """One watch event (kopf's `event["type"]`: None for the initial listing, ADDED, MODIFIED,
        DELETED) and its object."""
        meta = obj.get("metadata") or {}
        key = (meta.get("namespace", ""), meta.get("name", ""))
        ours = (meta.get("labels") or {}).get(MANAGED_BY_LABEL) == MANAGED_BY
        with self._lock:
            if event_type == "DELETED" or not ours or meta.get("deletionTimestamp"):
                self._objects.pop(key, None)
            else:
                self._objects[key] = obj

    def get(self, namespace: str, name: str) -> dict | None:
        """The object as last seen, or None when the watch has not delivered it (or it is gone)."""
        with self._lock:
            return self._objects.get((namespace, name))

    def __len__(self) -> int:
        with self._lock:
            return len(self._objects)
