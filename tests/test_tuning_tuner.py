"""Tuner.tick's acting half against real servers: the ConfigMap callback before the pods, every ready pod
patched live, late pods and unreachable ones brought in line on later ticks, nothing committed when no pod
took a change, observe mode touching nothing; plus the status, condition, Event and operator metrics.
The observations are given (a canned MetricsSource): deciding is tested in test_tuning_decide*.py, reading
metrics in test_tuning_observe.py and test_tuning_live.py."""

from __future__ import annotations

import logging

import pytest

from iterserve.common.wire import Knobs
from iterserve.operator.tuning.operator_metrics import OperatorMetrics
from iterserve.operator.tuning.pod_admin import get_scheduler
from iterserve.operator.tuning.policy import TuningPolicy
from iterserve.operator.tuning.tuner import Tuner
from tests.server_support import InProcessServer, free_port
from tests.tuning_windows import GOOD_BUSY, window

TOKEN = "admin-secret-for-tests"
START = Knobs(max_num_seqs=4, max_num_batched_tokens=512, prefill_chunk_size=128)
POLICY = TuningPolicy(ttft_p99_ms=1000, itl_p99_ms=100, max_num_seqs_bounds=(1, 32), interval_s=1, window_s=1,
                      cooldown_s=0, min_samples=20, seqs_step=2)


class CannedSource:
    """Hands out the given observations; records the windows it was asked for and the snapshots."""

    def __init__(self, obs):
        self.obs = obs
        self.calls, self.snapshots = [], []

    def observe(self, pod_urls, now, window_s, since=None):
        self.calls.append((list(pod_urls), now, since))
        return self.obs

    def snapshot(self, pod_urls, now):
        self.snapshots.append(now)


@pytest.fixture(scope="module")
def pods(tiny_dir):
    model = tiny_dir
    servers = [InProcessServer(model, admin_token=TOKEN, max_num_seqs=4, prefill_chunk_size=128) for _ in range(3)]
    for s in servers:
        s.__enter__()
    yield [s.url for s in servers]
    for s in servers:
        s.__exit__(None, None, None)


@pytest.fixture(autouse=True)
def reset(pods):
    from iterserve.operator.tuning.pod_admin import patch_scheduler

    for url in pods:
        patch_scheduler(url, TOKEN, START.as_dict())


def make_tuner(urls, policy=POLICY, obs=GOOD_BUSY, apply=None, metrics=None):
    ready = list(urls)
    tuner = Tuner("team-a", "chat", list_pods=lambda: ready, admin_token=TOKEN, policy=policy,
                  source=CannedSource(obs), knobs=START, apply_knobs=apply, metrics=metrics, clock=lambda: 100.0)
    return tuner, ready


def seqs(url):
    return get_scheduler(url, TOKEN)["knobs"]["max_num_seqs"]


def test_change_goes_to_the_configmap_first_then_every_pod(pods):
    calls = []
    metrics = OperatorMetrics()
    tuner, _ = make_tuner(pods[:2], apply=lambda k: calls.append((k, [seqs(u) for u in pods[:2]])), metrics=metrics)
    rec = tuner.tick(now=10.0)
    assert rec.decision.action == "raise_max_num_seqs" and rec.changed and not rec.errors
    assert calls == [(START.replace(max_num_seqs=6), [4, 4])]  # written before any pod changed
    assert [seqs(u) for u in pods[:2]] == [6, 6] and seqs(pods[2]) == 4
    assert tuner.state.knobs.max_num_seqs == 6 and tuner.source.snapshots == [100.0]
    status = rec.status()
    assert status["knobs"] == {"maxNumSeqs": 6, "maxNumBatchedTokens": 512, "prefillChunkSize": 128}
    assert status["ttftP99Ms"] == 500 and status["itlP99Ms"] == 50 and status["kvCacheUsage"] == 0.3
    assert status["lastDecision"]["action"] == "raise_max_num_seqs" and status["lastDecision"]["time"].endswith("Z")
    assert rec.condition()["type"] == "Tuned" and rec.condition()["status"] == "True"
    assert rec.event()["reason"] == "KnobsChanged" and "max_num_seqs=6" in rec.event()["message"]
    text = metrics.render().decode()
    assert 'iterserve_operator_knob{knob="max_num_seqs",namespace="team-a",service="chat"} 6.0' in text
    assert 'iterserve_operator_tuning_decisions_total{action="raise_max_num_seqs",namespace="team-a",' \
           'service="chat"} 1.0' in text
    metrics.forget("team-a", "chat")
    assert 'service="chat"' not in metrics.render().decode()


def test_next_window_starts_after_the_change(pods):
    tuner, _ = make_tuner(pods[:1])
    tuner.tick(now=10.0)
    tuner.tick(now=12.0)
    assert [since for _, _, since in tuner.source.calls] == [None, 10.0]


def test_a_pod_that_appears_later_gets_the_knobs_in_force(pods):
    tuner, ready = make_tuner(pods[:1], policy=POLICY.replace(min_samples=10**6))  # decide nothing
    tuner.state = tuner.state.__class__(START.replace(max_num_seqs=9))
    ready.append(pods[1])
    rec = tuner.tick(now=10.0)
    assert rec.decision.action == "hold" and not rec.errors
    assert seqs(pods[0]) == 9 and seqs(pods[1]) == 9


def test_unreachable_pod_is_reported_and_retried(pods):
    dead = f"http://127.0.0.1:{free_port()}"
    tuner, ready = make_tuner([pods[0], dead])
    rec = tuner.tick(now=10.0)
    assert rec.changed and seqs(pods[0]) == 6
    assert len(rec.errors) == 2 and all(dead in e for e in rec.errors)  # not synced, then not patched
    ready[1] = pods[1]  # the pod came back (under a new address): it gets the knobs in force next tick
    tuner.policy = POLICY.replace(min_samples=10**6)
    rec = tuner.tick(now=11.0)
    assert not rec.errors and seqs(pods[1]) == 6


def test_nothing_committed_when_no_pod_took_the_change(pods):
    dead = f"http://127.0.0.1:{free_port()}"
    written = []
    tuner, _ = make_tuner([dead], apply=written.append)
    rec = tuner.tick(now=10.0)
    assert not rec.changed and tuner.state.knobs == START
    assert written == [START.replace(max_num_seqs=6), START]  # the ConfigMap was put back
    assert rec.event()["reason"] == "KnobsNotApplied"


def test_failed_configmap_write_changes_nothing(pods):
    def refuse(knobs):
        raise RuntimeError("configmaps is forbidden")

    tuner, _ = make_tuner(pods[:1], apply=refuse)
    rec = tuner.tick(now=10.0)
    assert not rec.changed and seqs(pods[0]) == 4 and "forbidden" in rec.errors[0]


def test_observe_mode_recommends_and_touches_nothing(pods):
    tuner, _ = make_tuner(pods[:1], policy=POLICY.replace(mode="observe"),
                          apply=lambda k: pytest.fail("observe mode wrote the ConfigMap"))
    rec = tuner.tick(now=10.0)
    assert rec.decision.action == "raise_max_num_seqs" and not rec.changed
    assert seqs(pods[0]) == 4 and rec.knobs == START
    assert rec.event()["reason"] == "KnobsRecommended"


def test_set_knobs_restarts_the_window(pods):
    tuner, _ = make_tuner(pods[:1])
    tuner.set_knobs(START.replace(max_num_seqs=12), now=50.0)
    tuner.tick(now=51.0)
    assert tuner.source.calls[-1][2] == 50.0 and seqs(pods[0]) == 14


def test_a_verdict_that_turns_without_a_move_is_logged(pods, caplog):
    from tests.tuning_windows import GOOD_IDLE

    tuner, _ = make_tuner(pods[:1], obs=GOOD_IDLE)  # SLO met, nothing waits: no move
    with caplog.at_level(logging.INFO, logger="iterserve.operator.tuning"):
        assert tuner.tick(now=10.0).decision.action == "hold"
        tuner.tick(now=11.0)  # the same verdict again: nothing more to say
    turns = [r.getMessage() for r in caplog.records if "Tuned" in r.getMessage()]
    assert len(turns) == 1 and "team-a/chat: Tuned Unknown/NotObserved -> True/SLOMet" in turns[0]


def test_a_move_the_scaler_grows_the_fleet_on_is_decided_again_before_it_is_applied(pods):
    """The scaler ticks after the tuner, on its record: `scales_out` asks it first, with the move not yet
    applied. A larger chunk with ITL over (a new queue) on the window the fleet grows on is held; no pod
    nor the ConfigMap sees it. Where the scaler would not grow the fleet, the raise goes through."""
    growing = window(ttft=1510, itl=113, waiting=8, running=2)  # the cap (4) does not bind: a larger chunk
    asked, applied = [], []

    def scales_out(record):
        asked.append((record.decision.action, record.knobs.prefill_chunk_size))
        return True

    tuner, _ = make_tuner(pods[:1], obs=growing, apply=applied.append)
    rec = tuner.tick(now=10.0, scales_out=scales_out)
    assert asked == [("raise_prefill_chunk_size", 256), ("hold", 128)]
    assert rec.decision.action == "hold" and not rec.changed and applied == []
    assert "about to start: not raising the chunk" in rec.decision.reason, rec.decision.reason
    assert get_scheduler(pods[0], TOKEN)["knobs"]["prefill_chunk_size"] == 128
    tuner, _ = make_tuner(pods[:1], obs=growing, apply=applied.append)
    rec = tuner.tick(now=10.0, scales_out=lambda record: False)
    assert rec.decision.action == "raise_prefill_chunk_size" and rec.changed
    assert get_scheduler(pods[0], TOKEN)["knobs"]["prefill_chunk_size"] == 256
