"""Traffic from pods in the cluster while the cluster changes things: a rollout under a bench, a pod
deleted in the middle of its streams, the tuner changing knobs under load, a pod with a standing queue
taken out of the Service's rotation (the real endpoints controller and kube-proxy) and back. Nothing a
client sent fails."""

from __future__ import annotations

from e2e.support import (
    READY_TIMEOUT,
    SPEC,
    ClientPod,
    apply_service,
    get,
    kubectl,
    ready_pods,
    restarts,
    service_url,
    wait_ready,
    wait_until,
)


def test_template_edit_rolls_out_under_a_bench_without_a_failed_request(namespace):
    ns = namespace
    apply_service(ns, SPEC)
    wait_ready(ns)
    (old,) = ready_pods(ns, "chat")
    bench = ClientPod(ns, "bench", service_url(ns), "--concurrency", "2", prefix="bench")
    bench.wait_for_line("LOAD STARTED")
    # a template change (the drain timeout is in the pod spec): a surge pod, then the old one drains
    apply_service(ns, {**SPEC, "drainTimeoutSeconds": 45})
    wait_until(lambda: (ready := ready_pods(ns, "chat")) and len(ready) == 1
               and ready[0]["metadata"]["uid"] != old["metadata"]["uid"], "the rollout", timeout=READY_TIMEOUT)
    wait_until(lambda: get("pod", old["metadata"]["name"], ns) is None, "the old pod to finish draining",
               timeout=READY_TIMEOUT)
    bench.stop()
    result = bench.summary()
    assert result["requests"] >= 4 and result["errors"] == [], result
    assert result["ok"] == result["requests"]


def test_pod_deleted_mid_stream_finishes_its_streams(namespace):
    ns = namespace
    apply_service(ns, SPEC)
    wait_ready(ns)
    (pod,) = ready_pods(ns, "chat")
    streams = ClientPod(ns, "streams", f"http://{pod['status']['podIP']}:8000", "--streams", "3",
                        "--max-tokens", "160", prefix="streams")
    streams.wait_for_line("STREAMS STARTED")
    # graceful deletion: preStop, SIGTERM, the server drains what it has in flight, then exits
    kubectl("delete", "pod", pod["metadata"]["name"], "-n", ns, "--wait=false")
    result = streams.summary()
    for stream in result["streams"]:
        assert stream.get("status") == 200 and stream.get("finish_reason") == "length", result
        assert stream["completion_tokens"] == 160, result
    # the pod went and the Deployment replaced it
    wait_until(lambda: get("pod", pod["metadata"]["name"], ns) is None, "the drained pod to go")
    wait_until(lambda: ready_pods(ns, "chat"), "a replacement pod", timeout=READY_TIMEOUT)


def test_tuner_changes_knobs_under_load_without_a_restart(namespace):
    ns = namespace
    # max_num_seqs=1 under 6 clients: 5 requests queue behind the one in the batch, so p99 TTFT is several
    # request durations, far above a 500 ms objective on any CPU; the tuner's cure is raising max_num_seqs.
    spec = {**SPEC, "engine": {**SPEC["engine"], "maxNumSeqs": 1},
            "slo": {"ttftP99Ms": 500, "itlP99Ms": 60000},
            # a 30 s window holds enough first tokens to judge even at one request in the batch
            "tuning": {"mode": "auto", "intervalSeconds": 5, "windowSeconds": 30,
                       "bounds": {"maxNumSeqs": {"min": 1, "max": 8}}}}
    apply_service(ns, spec)
    wait_ready(ns)
    (pod,) = ready_pods(ns, "chat")
    generation = get("deployment", "chat", ns)["metadata"]["generation"]
    bench = ClientPod(ns, "bench", service_url(ns), "--concurrency", "6", "--output-len", "16", prefix="bench")
    bench.wait_for_line("LOAD STARTED")
    tuned = wait_until(lambda: (o := get("llmservice", "chat", ns)) and o["status"].get("knobs", {}).get(
        "maxNumSeqs", 1) > 1 and o, "the tuner to raise max_num_seqs", timeout=READY_TIMEOUT, interval=3)
    configmap = get("configmap", "chat-knobs", ns)
    bench.stop()
    result = bench.summary()
    assert result["errors"] == [] and result["ok"] > 0, result
    assert int(configmap["data"]["max-num-seqs"]) == tuned["status"]["knobs"]["maxNumSeqs"] > 1
    # live: the same pod, never restarted, the Deployment's template untouched by the tuner
    (same,) = ready_pods(ns, "chat")
    assert same["metadata"]["uid"] == pod["metadata"]["uid"] and restarts(same) == 0
    assert get("deployment", "chat", ns)["metadata"]["generation"] == generation


def rotation_of(ns: str, pod: dict) -> str | None:
    return ((get("pod", pod["metadata"]["name"], ns) or {})["metadata"].get("labels") or {}).get(
        "iterserve.io/rotation")


def endpoint_ips(ns: str, name: str = "chat") -> set[str]:
    """The ready addresses the Endpoints controller gives the Service: where kube-proxy sends its clients."""
    endpoints = get("endpoints", name, ns) or {}
    return {a["ip"] for subset in endpoints.get("subsets") or () for a in subset.get("addresses") or ()}


def test_a_pod_with_a_standing_queue_leaves_the_service_until_it_drains(namespace):
    ns = namespace
    # max_num_seqs held at 1 by its bounds: 8 clients sent straight to one pod queue 7 deep there, its peer idle
    spec = {**SPEC, "replicas": 2, "engine": {**SPEC["engine"], "maxNumSeqs": 1},
            "slo": {"ttftP99Ms": 60000, "itlP99Ms": 60000},
            "tuning": {"mode": "auto", "intervalSeconds": 5, "windowSeconds": 30,
                       "bounds": {"maxNumSeqs": {"min": 1, "max": 1}}}}
    apply_service(ns, spec)
    wait_until(lambda: len(ready_pods(ns, "chat")) == 2, "2 pods ready", timeout=READY_TIMEOUT, interval=3)
    busy, idle = ready_pods(ns, "chat")
    both = {busy["status"]["podIP"], idle["status"]["podIP"]}
    wait_until(lambda: endpoint_ips(ns) == both, "both pods in the Service's endpoints")
    flood = ClientPod(ns, "bench", f"http://{busy['status']['podIP']}:8000", "--concurrency", "8",
                      "--output-len", "32", prefix="flood")
    flood.wait_for_line("LOAD STARTED")
    wait_until(lambda: rotation_of(ns, busy) == "out", "the operator to take the busy pod out of rotation", interval=1)
    wait_until(lambda: endpoint_ips(ns) == {idle["status"]["podIP"]}, "the Service's endpoints without it", interval=1)
    assert len(ready_pods(ns, "chat")) == 2  # still Ready, still serving its queue
    flood.stop()
    result = flood.summary()
    assert result["errors"] == [] and result["ok"] > 0, result
    wait_until(lambda: rotation_of(ns, busy) == "in", "the drained pod back in rotation", interval=1)
    wait_until(lambda: endpoint_ips(ns) == both, "both pods in the Service's endpoints again", interval=1)
