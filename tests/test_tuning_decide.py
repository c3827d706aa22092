"""decide() on tables of observation sequences: each row feeds windows one interval apart and checks the
action taken on each, the knobs after it and the Tuned verdict."""

from __future__ import annotations

import dataclasses

import pytest

from iterserve.common.wire import Knobs
from iterserve.operator.tuning.decide import (
    BACK_OFF_SEQS,
    CLAMP,
    HOLD,
    LOWER_CHUNK,
    RAISE_CHUNK,
    RAISE_SEQS,
    ROLLBACK,
    TunerState,
    decide,
)
from iterserve.operator.tuning.failures import same_mix
from iterserve.operator.tuning.policy import InvalidPolicyError, TuningPolicy
from tests.tuning_windows import (
    BAND,
    BOTH_OVER,
    BOTH_OVER_QUEUED,
    GOOD_BUSY,
    GOOD_IDLE,
    ITL_OVER,
    ONSET,
    ONSET_QUEUED,
    POLICY,
    SEVERE,
    STALL,
    STALL_QUEUED,
    START,
    TTFT_OVER_NO_QUEUE,
    TTFT_OVER_QUEUED,
    actions,
    run,
    seqs,
    window,
)


@pytest.mark.parametrize("name, windows, want_actions, want_seqs, want_tuned", [
    ("steady load with headroom raises step by step", [GOOD_BUSY] * 4,
     [RAISE_SEQS] * 4, [10, 12, 14, 16], "True"),
    ("steady load, nothing waits: no reason to raise", [GOOD_IDLE] * 3, [HOLD] * 3, [8, 8, 8], "True"),
    ("requests wait for a step, not for a place: no reason to raise", [window(waiting=3, running=5)] * 3,
     [HOLD] * 3, [8, 8, 8], "True"),
    ("inside the hysteresis band nothing moves", [BAND] * 3, [HOLD] * 3, [8, 8, 8], "True"),
    ("overload: a mild breach is confirmed, then backed off multiplicatively", [BOTH_OVER] * 3,
     [HOLD, BACK_OFF_SEQS, BACK_OFF_SEQS], [8, 4, 2], "False"),
    ("a severe breach is acted on at once", [SEVERE], [BACK_OFF_SEQS], [4], "False"),
    ("both over while requests queue: a smaller chunk first, it costs no capacity", [BOTH_OVER_QUEUED] * 2,
     [HOLD, LOWER_CHUNK], [8, 8], "False"),
    ("KV pressure stops raising", [window(waiting=3, kv=0.95)] * 3, [HOLD] * 3, [8, 8, 8], "True"),
    ("preemption storm backs off to the bound, then says so", [window(waiting=3, preempt=2.0)] * 4,
     [BACK_OFF_SEQS, BACK_OFF_SEQS, HOLD, HOLD], [4, 2, 2, 2], "False"),
    ("failed engine steps back off", [window(errors=0.5)], [BACK_OFF_SEQS], [4], "False"),
    ("noisy windows: isolated mild breaches never act",
     [BAND, BOTH_OVER, BAND, GOOD_IDLE, BOTH_OVER, GOOD_IDLE, BAND, BOTH_OVER], [HOLD] * 8, [8] * 8, "True"),
    # a p99 over a short window swings with whether a long prompt fell in it: every other window is a breach
    ("a breach in every other window is confirmed", [BAND, BOTH_OVER, BAND, BOTH_OVER],
     [HOLD, HOLD, HOLD, BACK_OFF_SEQS], [8, 8, 8, 4], "False"),
    ("one unconfirmed mild breach leaves a met SLO's verdict standing", [BAND, BOTH_OVER], [HOLD, HOLD], [8, 8],
     "True"),
    ("a confirmed breach turns the verdict", [BAND, BOTH_OVER, BOTH_OVER], [HOLD, HOLD, BACK_OFF_SEQS], [8, 8, 4],
     "False"),
    ("too few samples decide nothing", [window(ttft=5000, itl=900, n=5, waiting=9)] * 3, [HOLD] * 3, [8, 8, 8],
     "Unknown"),
    ("breach then recovery", [BOTH_OVER, BOTH_OVER, GOOD_IDLE, GOOD_IDLE], [HOLD, BACK_OFF_SEQS, HOLD, HOLD],
     [8, 4, 4, 4], "True"),
    ("TTFT over with a queue and ITL headroom: more seqs", [TTFT_OVER_QUEUED] * 2, [HOLD, RAISE_SEQS], [8, 10],
     "False"),
    ("a new load's onset: ITL over, then TTFT severe and the farther: capacity first", [STALL, ONSET],
     [HOLD, RAISE_CHUNK], [8, 8], "False"),
    ("the same with the batch cap binding: more seqs", [STALL_QUEUED, ONSET_QUEUED], [HOLD, RAISE_SEQS], [8, 10],
     "False"),
    # the running gauge, read at a few scrapes, can fall between one request's end and the next's start
    ("TTFT over, the gauge read the batch half full, Little's law full: the cap binds",
     [dataclasses.replace(window(ttft=1300, itl=40, waiting=8, running=4), inference_time_mean_s=1.6)],
     [RAISE_SEQS], [10], "False"),
    ("the same with the time in the batch saying half full too: not the cap",
     [dataclasses.replace(window(ttft=1300, itl=40, waiting=8, running=4), inference_time_mean_s=0.8)],
     [RAISE_CHUNK], [8], "False"),
])
def test_decision_table(name, windows, want_actions, want_seqs, want_tuned):
    decisions = run(windows)
    assert actions(decisions) == want_actions, [d.reason for d in decisions]
    assert seqs(decisions) == want_seqs
    assert decisions[-1].tuned.status == want_tuned
    for d in decisions:
        b = POLICY.max_num_seqs_bounds
        assert b.min <= d.state.knobs.max_num_seqs <= b.max
        assert d.reason


def test_back_off_halves_the_batch_that_ran_not_an_unfilled_cap():
    """Both p99s over with 10 requests running under a cap of 32: halving the cap would change nothing."""
    start = TunerState(START.replace(max_num_seqs=32))
    d = run([window(ttft=1300, itl=120, running=9.2)] * 2, state=start)
    assert actions(d) == [HOLD, BACK_OFF_SEQS] and seqs(d) == [32, 5]
    # preemptions too: the KV cache could not hold the 6 that ran
    d = run([window(preempt=1.0, running=6)], state=start)
    assert actions(d) == [BACK_OFF_SEQS] and seqs(d) == [3]
    # per pod: 12 running over 3 pods is 4 each
    spread = dataclasses.replace(window(ttft=3000, itl=400, running=12), num_pods=3)
    assert seqs(run([spread], state=start)) == [2]
    # the batch by Little's law when the gauge, read between two requests, says less: 5/s x 1.6 s = 8 ran
    little = dataclasses.replace(window(preempt=1.0, running=3), inference_time_mean_s=1.6)
    assert seqs(run([little], state=start)) == [4]


def test_overlapping_windows_confirm_a_breach_only_once_it_outlasts_a_window():
    """Ticks every 2 s over 10 s windows: one stall stays in five windows in a row. It must not confirm
    itself; a breach still there in a window that no longer overlaps the first one is acted on."""
    policy = POLICY.replace(interval_s=2, window_s=10, cooldown_s=10)
    passing = run([GOOD_IDLE] + [ITL_OVER] * 5 + [GOOD_IDLE], policy=policy, step=2)
    assert actions(passing) == [HOLD] * 7
    assert "p99 ITL over in 1 separate recent window(s), 2 needed" in passing[5].reason
    # the reason gives the count of the p99 that is over, not the larger of the two counts
    after_ttft = TunerState(START, num_ttft_breaches=3, ttft_breach_end=-5.0)
    d = run([window(ttft=300, itl=110)], state=after_ttft)
    assert actions(d) == [HOLD] and d[0].reason.startswith("p99 ITL over in 1 separate recent window(s), 2 needed")
    lasting = run([GOOD_IDLE] + [ITL_OVER] * 6, policy=policy, step=2)
    assert actions(lasting) == [HOLD] * 6 + [LOWER_CHUNK]


def test_raise_that_breaks_the_slo_rolls_back_and_is_not_retried_at_once():
    d = run([GOOD_BUSY, BOTH_OVER, GOOD_BUSY, GOOD_BUSY])
    assert actions(d) == [RAISE_SEQS, ROLLBACK, HOLD, HOLD]
    assert seqs(d) == [10, 8, 8, 8]
    assert d[1].state.last_good == START
    assert "last good" in d[1].reason
    assert "not retried" in d[2].reason and d[2].tuned.status == "True"
    # after retry_after_s the setting is probed again; failing twice doubles the wait
    later = run([GOOD_BUSY, BOTH_OVER, GOOD_BUSY], state=d[-1].state, start_time=200)
    assert actions(later) == [RAISE_SEQS, ROLLBACK, HOLD]
    failed = {f.knobs.max_num_seqs: f for f in later[-1].state.failed}
    assert failed[10].num_failures == 2 and failed[10].until == 210 + 2 * POLICY.retry_after_s


def test_raise_that_brings_preemptions_rolls_back_even_in_cooldown():
    policy = POLICY.replace(cooldown_s=60)
    d = run([GOOD_BUSY, window(waiting=3, preempt=1.0)], policy=policy)
    assert actions(d) == [RAISE_SEQS, ROLLBACK]
    assert seqs(d) == [10, 8]


def test_correction_that_makes_a_breach_worse_is_reverted():
    # TTFT over with a queue: more seqs; the next window is worse still, so back to the setting before
    worse = window(ttft=1600, itl=140, waiting=4)
    d = run([TTFT_OVER_QUEUED, TTFT_OVER_QUEUED, worse, TTFT_OVER_QUEUED])
    assert actions(d) == [HOLD, RAISE_SEQS, ROLLBACK, RAISE_CHUNK]
    assert seqs(d) == [8, 10, 8, 8]
    assert "setting before it" in d[2].reason
    # a correction that helps, even without meeting the SLO yet, is kept
    better = window(ttft=1100, itl=40, waiting=2)
    kept = run([TTFT_OVER_QUEUED, TTFT_OVER_QUEUED, better])
    assert actions(kept) == [HOLD, RAISE_SEQS, RAISE_SEQS]


def test_no_better_setting_once_every_move_failed():
    # both over, nothing queued: back off, then a smaller chunk, then half a chunk step; each makes ITL worse
    # and is reverted
    worse = window(ttft=1400, itl=150)
    d = run([BOTH_OVER, BOTH_OVER, worse, BOTH_OVER, worse, BOTH_OVER, worse, BOTH_OVER])
    assert actions(d) == [HOLD, BACK_OFF_SEQS, ROLLBACK, LOWER_CHUNK, ROLLBACK, LOWER_CHUNK, ROLLBACK, HOLD]
    assert d[3].state.knobs.prefill_chunk_size * 2 == START.prefill_chunk_size  # a full step, then half of one
    assert d[5].state.knobs.prefill_chunk_size == 96
    assert d[-1].state.knobs == START
    assert d[-1].tuned.reason == "NoBetterSetting" and d[-1].tuned.message.count("retry in") == 3
    assert "p99 ITL/SLO 1.20 -> 1.50 with no more prefill work" in d[2].reason


def test_ttft_over_with_itl_tight_makes_itl_room_before_adding_sequences():
    tight = window(ttft=1300, itl=90, waiting=4)
    roomy = window(ttft=1300, itl=60, waiting=4)
    d = run([tight, tight, roomy])
    assert actions(d) == [HOLD, LOWER_CHUNK, RAISE_SEQS]
    assert d[-1].state.knobs == START.replace(prefill_chunk_size=64, max_num_seqs=10)


def test_more_throughput_forgives_a_ttft_that_a_backlog_still_grows():
    grown = dataclasses.replace(window(ttft=1800, itl=50, waiting=9), request_rate=8)
    d = run([TTFT_OVER_QUEUED, TTFT_OVER_QUEUED, grown])
    assert actions(d) == [HOLD, RAISE_SEQS, RAISE_SEQS]


def test_correction_that_pushes_the_other_p99_over_is_reverted():
    # TTFT was at 1.3 of its SLO; the raise left it over (1.1) and took ITL from 0.4 to 1.1
    pushed = dataclasses.replace(window(ttft=1100, itl=110, waiting=4), request_rate=8)
    d = run([TTFT_OVER_QUEUED, TTFT_OVER_QUEUED, pushed])
    assert actions(d) == [HOLD, RAISE_SEQS, ROLLBACK]
    assert "p99 ITL went over its SLO (0.40 -> 1.10)" in d[-1].reason


@pytest.mark.parametrize("after, want", [
    # ITL at 1.3 of its SLO; a smaller chunk brings it under and TTFT mildly over, less than ITL was: kept,
    # and the new breach must be confirmed like any other before the chunk goes back up
    ([window(ttft=1200, itl=80)] * 2, [HOLD, RAISE_CHUNK]),
    # TTFT over farther than ITL was: reverted at once
    ([window(ttft=1400, itl=80)], [ROLLBACK]),
    # ITL still over: the cure did not work, and it cost TTFT
    ([window(ttft=1200, itl=110)], [ROLLBACK]),
])
def test_a_cure_that_trades_its_breach_for_a_smaller_one_is_kept(after, want):
    before = window(ttft=600, itl=130)
    d = run([before, before] + after)
    assert actions(d)[:2] == [HOLD, LOWER_CHUNK]
    assert actions(d)[2:] == want


def test_back_off_leaves_a_ceiling_for_the_raises_after_it():
    d = run([BOTH_OVER, BOTH_OVER, GOOD_BUSY, GOOD_BUSY])
    assert actions(d) == [HOLD, BACK_OFF_SEQS, RAISE_SEQS, HOLD]
    assert seqs(d) == [8, 4, 6, 6] and "not retried" in d[-1].reason


def test_undoing_the_last_move_marks_it_failed_so_two_cures_do_not_take_turns():
    # a larger chunk for TTFT, later a smaller one for ITL: back where it was, the larger one is not retried
    d = run([TTFT_OVER_NO_QUEUE] * 2 + [GOOD_IDLE] + [ITL_OVER] * 2 + [GOOD_IDLE] + [TTFT_OVER_NO_QUEUE] * 2)
    assert actions(d) == [HOLD, RAISE_CHUNK, HOLD, HOLD, LOWER_CHUNK, HOLD, HOLD, HOLD]
    assert [x.state.knobs.prefill_chunk_size for x in d] == [128, 256, 256, 256, 128, 128, 128, 128]
    assert d[-1].tuned.reason == "NoBetterSetting"


@pytest.mark.parametrize("prompt_token_rate, last_action, last_chunk", [
    (140, HOLD, 128),  # 28 prompt tokens a request against 20: the same chats, the failure stands
    (2000, RAISE_CHUNK, 256),  # 400 a request: long documents, where the larger chunk may be the cure
])
def test_a_failure_blocks_only_under_a_like_load(prompt_token_rate, last_action, last_chunk):
    # the turns of the test above; the last TTFT breach comes with a load of `prompt_token_rate` / 5 prompt
    # tokens per request, against 20 when the larger chunk was undone for ITL
    later = dataclasses.replace(TTFT_OVER_NO_QUEUE, prompt_token_rate=prompt_token_rate)
    d = run([TTFT_OVER_NO_QUEUE] * 2 + [GOOD_IDLE] + [ITL_OVER] * 2 + [GOOD_IDLE] + [later] * 2)
    assert actions(d) == [HOLD, RAISE_CHUNK, HOLD, HOLD, LOWER_CHUNK, HOLD, HOLD, last_action]
    assert d[-1].state.knobs.prefill_chunk_size == last_chunk


def test_failures_under_two_loads_are_kept_side_by_side():
    # chats undo the larger chunk (256 fails for them, and so does anything larger); documents then undo
    # the smaller one (128 fails for them); back to chats, 512 is still blocked: the documents' failure
    # was kept beside the chats' one, not in its place
    docs = dataclasses.replace(TTFT_OVER_NO_QUEUE, prompt_token_rate=2000)
    d = run([TTFT_OVER_NO_QUEUE] * 2 + [GOOD_IDLE] + [ITL_OVER] * 2 + [GOOD_IDLE] + [docs] * 2 + [GOOD_IDLE]
            + [TTFT_OVER_NO_QUEUE] * 2)
    assert actions(d) == [HOLD, RAISE_CHUNK, HOLD, HOLD, LOWER_CHUNK, HOLD, HOLD, RAISE_CHUNK, HOLD, HOLD, HOLD]
    assert {(f.knobs.prefill_chunk_size, f.mix) for f in d[-1].state.failed} == {(256, 20), (128, 400)}
    assert d[-1].tuned.reason == "NoBetterSetting"


@pytest.mark.parametrize("a, b, alike", [
    (20, 29, True), (20, 31, False), (31, 20, False), (None, 400, True), (0.2, 1.4, True), (0.0, 2.0, False),
])
def test_same_mix(a, b, alike):
    assert same_mix(a, b, 1.5) is alike  # within 1.5x, below one token a request counting as one


def test_cooldown_holds_between_changes():
    d = run([GOOD_BUSY] * 4, policy=POLICY.replace(cooldown_s=25))
    assert actions(d) == [RAISE_SEQS, HOLD, HOLD, RAISE_SEQS]
    assert "cooling down" in d[1].reason


def test_knobs_outside_the_bounds_are_clamped_first():
    d = decide(TunerState(Knobs(max_num_seqs=100, prefill_chunk_size=4)), None, POLICY, 0)
    assert d.action == CLAMP and d.applied
    assert (d.knobs.max_num_seqs, d.knobs.prefill_chunk_size) == (32, 32)


def test_observe_mode_recommends_without_moving():
    d = run([GOOD_BUSY] * 3, policy=POLICY.replace(mode="observe"))
    assert actions(d) == [RAISE_SEQS] * 3
    assert all(not x.applied and x.knobs.max_num_seqs == 10 for x in d)
    assert seqs(d) == [8, 8, 8] and d[0].reason.startswith("recommended")


def test_observe_mode_remembers_no_ceiling_for_a_back_off_it_did_not_make():
    d = run([SEVERE, GOOD_BUSY], policy=POLICY.replace(mode="observe"))
    assert actions(d) == [BACK_OFF_SEQS, RAISE_SEQS] and d[-1].state.failed == ()


def test_off_mode_does_nothing():
    d = decide(TunerState(START), SEVERE, POLICY.replace(mode="off"), 0)
    assert d.action == HOLD and d.knobs is None and d.state.knobs == START


def test_upper_bound_is_never_passed():
    d = run([GOOD_BUSY] * 20)
    assert max(seqs(d)) == 32 and actions(d)[-1] == HOLD


@pytest.mark.parametrize("changes, field", [
    (dict(mode="turbo"), "mode"),
    (dict(ttft_p99_ms=0), "ttft_p99_ms"),
    (dict(max_num_seqs_bounds=(8, 4)), "max_num_seqs_bounds"),
    (dict(prefill_chunk_size_bounds={"min": 0, "max": 4}), "prefill_chunk_size_bounds.min"),
    (dict(headroom=1.2), "headroom"),
    (dict(backoff_factor=1), "backoff_factor"),
    (dict(min_samples=0), "min_samples"),
    (dict(chunk_factor=1.0), "chunk_factor"),
    (dict(cooldown_s=-1), "cooldown_s"),
])
def test_policy_rejects_bad_values_naming_the_field(changes, field):
    base = dataclasses.asdict(POLICY)
    base.update(changes)
    with pytest.raises(InvalidPolicyError) as info:
        TuningPolicy(**base)
    assert info.value.field == field


def test_policy_from_plain_values():
    p = TuningPolicy(ttft_p99_ms=2000, itl_p99_ms=200, max_num_seqs_bounds={"min": 1, "max": 64},
                     prefill_chunk_size_bounds=[16, 512], window_s=60)
    assert p.max_num_seqs_bounds.max == 64 and p.prefill_chunk_size_bounds.min == 16
    assert p.cooldown == 60
