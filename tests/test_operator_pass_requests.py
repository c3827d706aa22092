"""The requests one reconcile pass sends to the real API server: a pass that finds every child as it
renders it writes none, drift and spec changes are still applied, and the Deployment comes from the
watch-fed cache when that shows no drift (operator/child_cache.py); with the label-selected watches of
every child, an idle pass reads only what no watch holds."""

from __future__ import annotations

import json

from iterserve.operator import controller
from iterserve.operator.child_cache import ChildCache
from iterserve.operator.child_watch import start_child_watches
from iterserve.operator.kube import Kube
from tests.operator_support import apply_llmservice, merge_patch_llmservice
from tests.waiting import wait_until

WRITES = ("POST", "PATCH", "PUT", "DELETE")


class CountingKube(Kube):
    """The operator's client, recording (verb, resource path) of every request it sends."""

    def __init__(self, api_client):
        super().__init__(api_client)
        self.calls: list[tuple[str, str]] = []

    def request(self, method, path, body=None, **kwargs):
        self.calls.append((method, path))
        return super().request(method, path, body, **kwargs)

    def take(self) -> list[tuple[str, str]]:
        calls, self.calls = self.calls, []
        return calls


def child_writes(calls: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Writes other than the LLMService's status (which follows the Deployment's, set by its controller)."""
    return [(m, p) for m, p in calls if m in WRITES and not p.endswith("/status")]


def pass_of(kube: CountingKube, ns: str, name: str) -> list[tuple[str, str]]:
    body = kube.get_llmservice(ns, name)
    kube.take()
    result = controller.handle(kube, body)
    assert not result.problems, result.problems
    return kube.take()


def test_a_pass_over_children_as_rendered_writes_nothing_and_drift_is_still_applied(kube_cluster, kube_namespace):
    kube, ns = CountingKube(kube_cluster.api_client()), kube_namespace
    apply_llmservice(kube_cluster, ns, "chat", {"engine": {"maxNumSeqs": 12}})
    first = pass_of(kube, ns, "chat")
    assert ("POST", f"/apis/apps/v1/namespaces/{ns}/deployments") not in first  # created by apply (PATCH)
    assert any(m == "PATCH" and p.endswith("/deployments/chat") for m, p in first)
    idle = pass_of(kube, ns, "chat")
    print("requests of a pass that changes nothing:", json.dumps(idle))
    assert child_writes(idle) == []
    assert ("GET", f"/apis/apps/v1/namespaces/{ns}/deployments/chat") in idle

    # drift someone made: put back
    kube_cluster.kubectl("set", "image", "deployment/chat", "-n", ns, "server=example.com/other:1")
    repaired = pass_of(kube, ns, "chat")
    assert child_writes(repaired) == [("PATCH", f"/apis/apps/v1/namespaces/{ns}/deployments/chat")]
    image = kube.get("apps/v1", "Deployment", ns, "chat")["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image.startswith("ghcr.io/iterserve")

    # a spec change: rolled out (the Deployment's replicas), and a PodDisruptionBudget for 2 replicas
    merge_patch_llmservice(kube_cluster, ns, "chat", {"spec": {"replicas": 2}})
    changed = pass_of(kube, ns, "chat")
    assert ("PATCH", f"/apis/apps/v1/namespaces/{ns}/deployments/chat") in child_writes(changed)
    assert kube.get("apps/v1", "Deployment", ns, "chat")["spec"]["replicas"] == 2
    assert kube.get(kube.pdb_api_version, "PodDisruptionBudget", ns, "chat") is not None
    assert child_writes(pass_of(kube, ns, "chat")) == []


def test_the_cached_deployment_saves_the_get_and_drift_in_it_sends_the_pass_to_the_server(kube_cluster,
                                                                                          kube_namespace):
    kube, ns = CountingKube(kube_cluster.api_client()), kube_namespace
    apply_llmservice(kube_cluster, ns, "chat", {})
    pass_of(kube, ns, "chat")
    cache = kube.caches["Deployment"] = ChildCache("Deployment")
    deployment_path = f"/apis/apps/v1/namespaces/{ns}/deployments/chat"
    cache.observe("ADDED", kube.get("apps/v1", "Deployment", ns, "chat"))
    cached = pass_of(kube, ns, "chat")
    assert ("GET", deployment_path) not in cached and child_writes(cached) == []

    # the watch delivers an edit: the pass reads the Deployment from the server and puts it back
    kube_cluster.kubectl("set", "image", "deployment/chat", "-n", ns, "server=example.com/other:1")
    cache.observe("MODIFIED", kube.get("apps/v1", "Deployment", ns, "chat"))
    repaired = pass_of(kube, ns, "chat")
    assert ("GET", deployment_path) in repaired
    assert child_writes(repaired) == [("PATCH", deployment_path)]
    assert kube.get("apps/v1", "Deployment", ns, "chat")["spec"]["template"]["spec"]["containers"][0]["image"] \
        .startswith("ghcr.io/iterserve")

    # a deleted Deployment the watch has not reported yet: the pass sees no drift in its entry and skips;
    # the DELETED event empties the entry and the next pass creates it again
    cache.observe("MODIFIED", kube.get("apps/v1", "Deployment", ns, "chat"))  # the repair, as watched
    kube.delete("apps/v1", "Deployment", ns, "chat")
    kube.take()
    assert child_writes(pass_of(kube, ns, "chat")) == []
    cache.observe("DELETED", {"metadata": {"namespace": ns, "name": "chat"}})
    assert ("PATCH", deployment_path) in child_writes(pass_of(kube, ns, "chat"))
    assert kube.get("apps/v1", "Deployment", ns, "chat") is not None


def test_with_the_child_watches_an_idle_pass_reads_only_what_no_watch_holds(kube_cluster, kube_namespace):
    """The label-selected watches (operator/child_watch.py) hold every rendered child and the pods: an idle
    pass reads only the LLMService, the admin Secret and the knobs ConfigMap. The router's children and
    the PDB (off, 1 replica) are known absent, with no GET; once the router is turned on and off again,
    its children are deleted as before."""
    kube, ns = CountingKube(kube_cluster.api_client()), kube_namespace
    watches = start_child_watches(kube, [ns])
    try:
        apply_llmservice(kube_cluster, ns, "chat", {})
        pass_of(kube, ns, "chat")
        wait_until(lambda: all(kube.cached(kind, ns, "chat") for kind in ("Deployment", "Service", "NetworkPolicy")),
                   timeout=30, what="the children in the watches' caches")
        idle = pass_of(kube, ns, "chat")
        print("requests of an idle pass with the watches:", json.dumps(idle))
        # (a status write may follow the Deployment's status, which its controller is still setting)
        reads = sorted(c for c in idle if not c[1].endswith("/status"))
        assert reads == sorted([("GET", f"/apis/iterserve.io/v1alpha1/namespaces/{ns}/llmservices/chat"),
                                ("GET", f"/api/v1/namespaces/{ns}/secrets/iterserve-admin-tokens"),
                                ("GET", f"/api/v1/namespaces/{ns}/configmaps/chat-knobs")])

        merge_patch_llmservice(kube_cluster, ns, "chat", {"spec": {"router": {"enabled": True}}})
        pass_of(kube, ns, "chat")
        router = ("Deployment", "chat-router"), ("Service", "chat-pods"), ("NetworkPolicy", "chat-router")
        wait_until(lambda: all(kube.cached(kind, ns, name) for kind, name in router), timeout=30,
                   what="the router's children in the caches")
        merge_patch_llmservice(kube_cluster, ns, "chat", {"spec": {"router": {"enabled": False}}})
        off = pass_of(kube, ns, "chat")
        assert {(m, p.rsplit("/", 2)[-2] + "/" + p.rsplit("/", 1)[-1]) for m, p in child_writes(off)
                if m == "DELETE"} == {("DELETE", "deployments/chat-router"), ("DELETE", "services/chat-pods"),
                                      ("DELETE", "networkpolicies/chat-router")}
        wait_until(lambda: all(kube.known_absent(kind, ns, name) for kind, name in router), timeout=30,
                   what="the deletions in the caches")
        assert child_writes(pass_of(kube, ns, "chat")) == []
    finally:
        for watch in watches:
            watch.stop()


def test_a_status_refresh_claims_no_generation_a_full_pass_has_not_processed(kube_cluster, kube_namespace):
    """A Deployment's status change refreshes the LLMService's status; before any full pass has finished
    (an operator killed mid-pass left the Deployment behind) that refresh writes nothing, and after a spec
    change it keeps the generation the last full pass saw: kubectl wait must not see a spec as applied
    whose Service, PDB and NetworkPolicy nobody has created yet."""
    kube, ns = CountingKube(kube_cluster.api_client()), kube_namespace
    apply_llmservice(kube_cluster, ns, "chat", {"replicas": 2})
    kube.take()
    refreshed = controller.refresh_status(kube, ns, "chat")
    assert [c for c in kube.take() if c[0] in WRITES] == [] and refreshed.transitions == []
    assert "observedGeneration" not in (kube.get_llmservice(ns, "chat").get("status") or {})

    pass_of(kube, ns, "chat")
    assert kube.get_llmservice(ns, "chat")["status"]["observedGeneration"] == 1
    merge_patch_llmservice(kube_cluster, ns, "chat", {"spec": {"replicas": 3}})
    controller.refresh_status(kube, ns, "chat")
    stored = kube.get_llmservice(ns, "chat")
    assert stored["metadata"]["generation"] == 2 and stored["status"]["observedGeneration"] == 1
