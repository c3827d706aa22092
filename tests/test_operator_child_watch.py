"""The label-selected child watches (operator/child_watch.py) on the real API server, as the operator's
service account with the manifests' RBAC: they list and follow our labelled objects only, know absence
once listed, pick up again after the server ends a watch, and stop promptly."""

from __future__ import annotations

import time

from iterserve.operator import child_watch
from iterserve.operator.child_cache import ChildCache
from iterserve.operator.child_watch import ChildWatch, Watched, start_child_watches
from iterserve.operator.kube import Kube
from tests.operator_support import operator_rbac  # noqa: F401  (fixture)
from tests.waiting import wait_until

OURS = {"app.kubernetes.io/managed-by": "iterserve-operator", "app.kubernetes.io/instance": "chat"}


def service(ns: str, name: str, labels: dict) -> dict:
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": ns, "labels": labels},
            "spec": {"selector": {"app": name}, "ports": [{"port": 80}]}}


def test_a_watch_follows_our_labelled_services_and_knows_their_absence(kube_cluster, kube_namespace,
                                                                        operator_rbac):  # noqa: F811
    ns = kube_namespace
    admin = Kube(kube_cluster.api_client())
    kube = Kube(kube_cluster.api_client(kube_cluster.operator_kubeconfig))  # the manifests' rights only
    admin.create(service(ns, "listed", OURS))
    cache = ChildCache("Service")
    watch = ChildWatch(kube, Watched("Service", "v1"), cache, ns)
    assert not cache.absent(ns, "later")  # nothing listed yet: absence proves nothing
    watch.start()
    try:
        wait_until(lambda: cache.get(ns, "listed"), timeout=30, what="the listing")
        assert cache.get(ns, "listed")["kind"] == "Service"  # typed like the renderings it is compared with
        assert cache.absent(ns, "later") and cache.absent(ns, "theirs")

        admin.create(service(ns, "later", OURS))
        admin.create(service(ns, "theirs", {"app": "theirs"}))  # no managed-by label: never received
        wait_until(lambda: cache.get(ns, "later"), timeout=30, what="the ADDED event")
        admin.merge_patch("v1", "Service", ns, "later", {"metadata": {"annotations": {"seen": "yes"}}})
        wait_until(lambda: (cache.get(ns, "later")["metadata"].get("annotations") or {}).get("seen"), timeout=30,
                   what="the MODIFIED event")
        admin.delete("v1", "Service", ns, "listed")
        wait_until(lambda: cache.absent(ns, "listed"), timeout=30, what="the DELETED event")
        # our label taken away: the object leaves the cache rather than stand in it unchanged
        admin.merge_patch("v1", "Service", ns, "later",
                          {"metadata": {"labels": {"app.kubernetes.io/managed-by": None}}})
        wait_until(lambda: cache.get(ns, "later") is None, timeout=30, what="the label's removal")
        assert cache.get(ns, "theirs") is None and len(cache) == 0
    finally:
        watch.stop()
        watch.join(timeout=10)
    assert not watch.is_alive()


def test_a_watch_the_server_ends_resumes_without_losing_events(kube_cluster, kube_namespace, operator_rbac,  # noqa: F811
                                                               monkeypatch):
    ns = kube_namespace
    monkeypatch.setattr(child_watch, "WATCH_SECONDS", 1)  # the server ends every watch after a second
    kube = Kube(kube_cluster.api_client(kube_cluster.operator_kubeconfig))
    watches = start_child_watches(kube, [ns])
    try:
        assert {w.watched.kind for w in watches} == {"Deployment", "Service", "NetworkPolicy",
                                                     "PodDisruptionBudget", "Pod"}
        wait_until(lambda: all(kube.known_absent(w.watched.kind, ns, "x") for w in watches), timeout=30,
                   what="every kind listed")
        time.sleep(2.5)  # at least two watches ended by the server and resumed
        Kube(kube_cluster.api_client()).create(service(ns, "after", OURS))
        wait_until(lambda: kube.cached("Service", ns, "after"), timeout=30, what="the event after resuming")
        assert all(w.is_alive() for w in watches)
    finally:
        for watch in watches:
            watch.stop()
