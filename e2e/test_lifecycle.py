"""An LLMService's life on a real cluster: refused when invalid, Ready and answering through its Service,
a knob changed live, a deleted child recreated, everything gone with it."""

from __future__ import annotations

import base64

import httpx

from e2e.support import (
    MODEL,
    SPEC,
    ClientPod,
    PortForward,
    apply_service,
    get,
    kubectl,
    ready_pods,
    restarts,
    service_url,
    wait_ready,
    wait_until,
)


def test_llmservice_lifecycle_on_a_real_cluster(namespace):
    ns = namespace
    # the API server refuses a bad spec, naming the field
    bad = apply_service(ns, {**SPEC, "replicas": -1}, name="bad", check=False)
    assert bad.returncode != 0 and "spec.replicas" in bad.stderr, bad.stderr

    apply_service(ns, SPEC)
    svc = wait_ready(ns)
    assert svc["status"]["readyReplicas"] == 1 and svc["status"]["knobs"]["maxNumSeqs"] == 8
    uid = svc["metadata"]["uid"]
    for kind, name in [("deployment", "chat"), ("service", "chat"), ("configmap", "chat-knobs"),
                       ("networkpolicy", "chat")]:
        assert get(kind, name, ns)["metadata"]["ownerReferences"][0]["uid"] == uid, kind

    # completions through the Service: from a pod in the cluster (its ClusterIP) ...
    client = ClientPod(ns, "streams", service_url(ns), "--streams", "1", "--max-tokens", "8")
    (stream,) = client.summary()["streams"]
    assert stream["status"] == 200 and stream["finish_reason"] == "length" and stream["completion_tokens"] == 8, stream
    # ... and from a laptop, through kubectl port-forward
    with PortForward(ns, "svc/chat") as forward:
        answer = httpx.post(f"{forward.url}/v1/completions", timeout=120,
                            json={"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8,
                                  "temperature": 0})
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"], answer.text
        metrics = httpx.get(f"{forward.url}/metrics", timeout=30).text
        assert "vllm:time_to_first_token_seconds_bucket" in metrics
        # the image carries the C++ CPU kernels: the pod serves with them, not the torch fallback
        assert 'iterserve:cpu_kernels_available{kernel="paged_attention",model_name=' in metrics
        assert [line for line in metrics.splitlines() if line.startswith("iterserve:cpu_kernels_available{")
                and not line.endswith(" 1.0")] == []

    # a knob edit is applied live: the same pod (UID), no restart
    (pod,) = ready_pods(ns, "chat")
    apply_service(ns, {**SPEC, "engine": {**SPEC["engine"], "maxNumSeqs": 5}})
    token = base64.b64decode(get("secret", "iterserve-admin-tokens", ns)["data"]["chat"]).decode()
    with PortForward(ns, f"pod/{pod['metadata']['name']}", port=8001) as forward:  # the admin port
        wait_until(lambda: httpx.get(f"{forward.url}/admin/scheduler", headers={"Authorization": f"Bearer {token}"},
                                     timeout=10).json()["knobs"]["max_num_seqs"] == 5, "the live knob")
    (same,) = ready_pods(ns, "chat")
    assert same["metadata"]["uid"] == pod["metadata"]["uid"] and restarts(same) == 0
    assert get("llmservice", "chat", ns)["status"]["knobs"]["maxNumSeqs"] == 5

    # a deleted child comes back
    kubectl("delete", "service", "chat", "-n", ns)
    wait_until(lambda: get("service", "chat", ns), "the Service to be recreated")
    kubectl("delete", "configmap", "chat-knobs", "-n", ns)
    wait_until(lambda: get("configmap", "chat-knobs", ns), "the knobs ConfigMap to be recreated")

    # deleting the LLMService removes everything it owns, pods included
    kubectl("delete", "llmservice", "chat", "-n", ns)
    wait_until(lambda: all(get(kind, name, ns) is None for kind, name in [
        ("deployment", "chat"), ("service", "chat"), ("configmap", "chat-knobs"), ("networkpolicy", "chat")]),
        "garbage collection of the children")
    wait_until(lambda: not kubectl("get", "pods", "-n", ns, "-l", "app.kubernetes.io/instance=chat", "-o",
                                   "name").stdout.strip(), "the pods to go", timeout=300)
