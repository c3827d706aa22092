"""The decision function in a closed loop with a latency model (tests/tuning_latency_model.py) under
step-up, step-down and impossible loads: it converges to knobs that meet the SLO when some exist, says
Tuned=False with a reason when none within bounds can, never leaves the bounds, does not oscillate once
converged, and a change that brings preemptions is rolled back to the last good setting."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from iterserve.common.wire import Knobs
from iterserve.operator.tuning.decide import ROLLBACK, Decision, TunerState, decide
from iterserve.operator.tuning.policy import TuningPolicy
from tests.tuning_latency_model import LatencyModel

POLICY = TuningPolicy(ttft_p99_ms=1500, itl_p99_ms=40, max_num_seqs_bounds=(1, 64),
                      prefill_chunk_size_bounds=(16, 512), interval_s=30, window_s=30, seqs_step=4, min_samples=20)
START = Knobs(max_num_seqs=4, max_num_batched_tokens=512, prefill_chunk_size=256)
SEEDS = range(8)


@dataclass
class Tick:
    rate: float
    knobs: Knobs  # in force during the window
    decision: Decision


def simulate(model: LatencyModel, phases: list[tuple[float, int]], policy=POLICY, knobs=START) -> list[list[Tick]]:
    """Run the loop: each tick the server runs one interval at the knobs in force, then decide() sees it."""
    state, t, out = TunerState(knobs), 0.0, []
    for rate, num_ticks in phases:
        ticks = []
        for _ in range(num_ticks):
            obs = model.window(state.knobs, rate, t, t + policy.interval_s)
            t += policy.interval_s
            d = decide(state, obs, policy, t)
            ticks.append(Tick(rate, state.knobs, d))
            state = d.state
        out.append(ticks)
    return out


def meeting_settings(model: LatencyModel, rate: float, policy=POLICY) -> list[Knobs]:
    """Every setting in bounds (chunks in powers of two) that meets the SLO, noise-free: the ground truth."""
    b, c = policy.max_num_seqs_bounds, policy.prefill_chunk_size_bounds
    chunks = [x for x in (16, 32, 64, 128, 256, 512) if c.min <= x <= c.max]
    return [Knobs(max_num_seqs=s, prefill_chunk_size=x) for s in range(b.min, b.max + 1) for x in chunks
            if model.meets(Knobs(max_num_seqs=s, prefill_chunk_size=x), rate, policy.ttft_p99_ms / 1000,
                           policy.itl_p99_ms / 1000)]


def direction_changes(values: list[int]) -> int:
    steps = [b - a for a, b in zip(values, values[1:], strict=False) if b != a]
    return sum(1 for x, y in zip(steps, steps[1:], strict=False) if (x > 0) != (y > 0))


def assert_in_bounds(ticks: list[Tick], policy=POLICY) -> None:
    for tick in ticks:
        k = tick.decision.state.knobs
        assert k.max_num_seqs in policy.max_num_seqs_bounds and k.prefill_chunk_size in policy.prefill_chunk_size_bounds


def assert_settled(ticks: list[Tick], max_changes: int = 2) -> None:
    """In the phase's second half the knobs reverse direction at most `max_changes` times per knob."""
    tail = [t.decision.state.knobs for t in ticks[len(ticks) // 2:]]
    assert direction_changes([k.max_num_seqs for k in tail]) <= max_changes
    assert direction_changes([k.prefill_chunk_size for k in tail]) <= max_changes


@pytest.mark.parametrize("seed", SEEDS)
def test_step_up_then_step_down_converges_to_slo_meeting_knobs(seed):
    model = LatencyModel(seed=seed)
    phases = [(5, 30), (15, 60), (5, 30)]
    for rate, _ in phases:
        assert meeting_settings(model, rate), f"the scenario needs a feasible setting at rate {rate}"
    runs = simulate(model, phases)
    for (rate, _), ticks in zip(phases, runs, strict=True):
        assert_in_bounds(ticks)
        assert_settled(ticks)
        last = ticks[-1].decision
        assert last.tuned.status == "True", (rate, last.tuned, last.reason)
        assert model.meets(last.state.knobs, rate, 1.5, 0.040), (rate, last.state.knobs)
        # once converged the SLO holds: most of the phase's last quarter met it
        tail = ticks[-len(ticks) // 4:]
        assert sum(t.decision.slo_met for t in tail) >= 0.8 * len(tail)
    # the load rose from 5 to 15 requests/s: the tuner gave the batch more places, and kept them after
    assert runs[1][-1].knobs.max_num_seqs > runs[0][-1].knobs.max_num_seqs
    assert runs[2][-1].knobs.max_num_seqs >= runs[1][-1].knobs.max_num_seqs


@pytest.mark.parametrize("seed", SEEDS)
def test_impossible_load_says_tuned_false_with_a_reason(seed):
    model = LatencyModel(seed=seed)
    assert not meeting_settings(model, 35)
    (ticks,) = simulate(model, [(35, 60)])
    assert_in_bounds(ticks)
    assert_settled(ticks, max_changes=4)
    tail = [t.decision.tuned for t in ticks[len(ticks) // 2:]]
    assert all(c.status == "False" for c in tail)
    # it says why; the verdict stands while, now and then (less often each time), it probes a setting again
    assert all(c.reason in ("BoundsReached", "NoBetterSetting") and "p99 TTFT" in c.message for c in tail)


@pytest.mark.parametrize("seed", SEEDS)
def test_tight_bounds_that_cannot_meet_the_slo_say_bounds_reached(seed):
    model = LatencyModel(seed=seed)
    policy = POLICY.replace(max_num_seqs_bounds=(1, 8))
    assert not meeting_settings(model, 15, policy)
    (ticks,) = simulate(model, [(15, 40)], policy=policy)
    assert_in_bounds(ticks, policy)
    assert max(t.decision.state.knobs.max_num_seqs for t in ticks) == 8
    assert ticks[-1].decision.tuned.status == "False"


@pytest.mark.parametrize("seed", SEEDS)
def test_raise_into_preemptions_is_rolled_back_to_the_last_good_setting(seed):
    # the server preempts once running sequences hold 60% of the pool, below the 90% pressure threshold
    # that would stop a raise: while a backlog fills the batch, 16 sequences preempt
    model = LatencyModel(seed=seed, kv_tokens=5000, preempt_above=0.6)
    assert meeting_settings(model, 10)
    (ticks,) = simulate(model, [(10, 60)])
    assert_in_bounds(ticks)
    rollbacks = [i for i, t in enumerate(ticks) if t.decision.action == ROLLBACK]
    assert rollbacks, "the tuner never raised into the preemptions"
    for i in rollbacks:
        d, pending = ticks[i].decision, ticks[i - 1].decision.state.pending
        assert d.knobs == pending.before  # back to the setting before the change
        if pending.before_healthy:
            assert d.knobs == d.state.last_good
        assert d.state.blocked_until(ticks[i].knobs, d.time) is not None  # not retried at once
    assert_settled(ticks)
    last = ticks[-1].decision
    assert last.tuned.status == "True" and model.meets(last.state.knobs, 10, 1.5, 0.040)
    tail = ticks[-len(ticks) // 4:]
    assert not any("preemptions" in t.decision.reason for t in tail)
