"""act.patch_scheduler / get_scheduler against a real `iterserve serve` process: knobs change live, and
every failure is a PodCallError naming the pod and the server's own message."""

from __future__ import annotations

import pytest

from iterserve.operator.tuning.pod_admin import PodCallError, get_scheduler, patch_scheduler
from tests.server_support import free_port, metric_value, start_subprocess

TOKEN = "admin-secret-for-tests"


@pytest.fixture(scope="module")
def pod(tiny_dir):
    model = tiny_dir
    proc, url = start_subprocess("--model", model, "--kv-cache-memory", "8MiB", "--threads", "1",
                                 "--max-num-seqs", "4", "--admin-token", TOKEN)
    yield url
    proc.terminate()
    proc.wait(30)


def test_get_then_patch_changes_live_knobs(pod):
    import httpx

    before = get_scheduler(pod, TOKEN)
    assert before["knobs"]["max_num_seqs"] == 4
    answer = patch_scheduler(pod, TOKEN, {"max_num_seqs": 7, "prefill_chunk_size": 64})
    assert answer["changed"] == {"max_num_seqs": {"old": 4, "new": 7},
                                 "prefill_chunk_size": {"old": before["knobs"]["prefill_chunk_size"], "new": 64}}
    after = get_scheduler(pod, TOKEN)
    assert after["knobs"]["max_num_seqs"] == 7 and after["knobs"]["prefill_chunk_size"] == 64
    assert after["num_changes"] == before["num_changes"] + 1
    assert metric_value(httpx.get(pod + "/metrics").text, "iterserve:max_num_seqs") == 7


@pytest.mark.parametrize("token, knobs, status, words", [
    ("wrong-token", {"max_num_seqs": 5}, 401, "admin token"),
    (TOKEN, {"max_num_seqs": 0}, 400, "max_num_seqs: must be in [1,"),
    (TOKEN, {"max_num_seqs": 5, "prefill_chunk_size": -1}, 400, "prefill_chunk_size"),
])
def test_refusal_is_pod_call_error_with_server_message(pod, token, knobs, status, words):
    before = get_scheduler(pod, TOKEN)["knobs"]
    with pytest.raises(PodCallError) as info:
        patch_scheduler(pod, token, knobs)
    assert info.value.status == status
    assert pod in str(info.value) and words in str(info.value)
    assert get_scheduler(pod, TOKEN)["knobs"] == before  # nothing of a refused change applies


def test_unreachable_pod_names_its_url():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(PodCallError) as info:
        get_scheduler(url, TOKEN, timeout=2)
    assert info.value.status is None and url in str(info.value) and "ConnectError" in str(info.value)


def test_unknown_knob_refused_before_any_call():
    with pytest.raises(ValueError, match="block_size"):
        patch_scheduler("http://127.0.0.1:1", TOKEN, {"block_size": 32})
