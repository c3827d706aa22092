"""decide() on tables of observation sequences: each row feeds windows one interval apart and checks the
action taken on each, the knobs after it and the Tuned verdict."""

from __future__ import annotations

import dataclasses

import pytest

from iterserve.common.wire import Knobs
from iterserve.operator.tuning.corrections import gentler_chunk
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
from iterserve.operator.tuning.failures import mark_failed, same_mix
from iterserve.operator.tuning.observation import Observation
from iterserve.operator.tuning.policy import InvalidPolicyError, KnobBounds, TuningPolicy

POLICY = TuningPolicy(ttft_p99_ms=1000, itl_p99_ms=100, max_num_seqs_bounds=(2, 32),
                      prefill_chunk_size_bounds=(32, 512), interval_s=10, window_s=10, cooldown_s=10,
                      min_samples=20, seqs_step=2, retry_after_s=100)
START = Knobs(max_num_seqs=8, max_num_batched_tokens=512, prefill_chunk_size=128)


def window(ttft=500, itl=50, n=100, kv=0.3, waiting=0.0, preempt=0.0, errors=0.0, running=None) -> Observation:
    """One window's figures in ms, with its sample count and load signals; requests wait behind a full batch
    (as many running as the bounds allow) unless told otherwise, and without waiting START's cap runs full."""
    running = (32 if waiting else 8) if running is None else running
    return Observation(start=0, end=10, num_pods=1, num_samples=n, ttft_p99_s=ttft / 1000, itl_p99_s=itl / 1000,
                       request_rate=5, prompt_token_rate=100, generation_token_rate=200, waiting=waiting,
                       running=running,
                       queue_time_mean_s=None, kv_usage=kv, preemption_rate=preempt, error_rate=errors)


GOOD_BUSY = window(ttft=500, itl=50, waiting=3)  # both p99s well under SLO, requests queue
GOOD_IDLE = window(ttft=500, itl=50)  # nothing waits
BAND = window(ttft=900, itl=60, waiting=3)  # met, but TTFT within the 20% headroom
BOTH_OVER = window(ttft=1300, itl=120)
BOTH_OVER_QUEUED = window(ttft=1300, itl=120, waiting=3)
SEVERE = window(ttft=3000, itl=400)
ITL_OVER = window(ttft=300, itl=130)  # decode stalls while first tokens come early
TTFT_OVER_QUEUED = window(ttft=1300, itl=40, waiting=4)
TTFT_OVER_NO_QUEUE = window(ttft=1300, itl=40)
# a new load's onset: its prompts stall the decodes left from the last one (ITL over, confirmed by the
# next window), then queue (TTFT severe)
STALL = window(ttft=900, itl=120)
STALL_QUEUED = window(ttft=900, itl=120, waiting=3)
ONSET = window(ttft=2500, itl=120)
ONSET_QUEUED = window(ttft=2500, itl=120, waiting=3)


def run(windows, policy=POLICY, state=None, start_time=0.0, step=10.0):
    state = state or TunerState(START)
    decisions = []
    for i, obs in enumerate(windows):
        now = start_time + i * step
        d = decide(state, dataclasses.replace(obs, start=now - policy.window_s, end=now), policy, now)
        decisions.append(d)
        state = d.state
    return decisions


def actions(decisions):
    return [d.action for d in decisions]


def seqs(decisions):
    return [d.state.knobs.max_num_seqs for d in decisions]


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


def test_itl_breach_with_ttft_headroom_lowers_chunk_then_backs_off_at_its_bound():
    d = run([ITL_OVER] * 5)
    assert actions(d) == [HOLD, LOWER_CHUNK, LOWER_CHUNK, BACK_OFF_SEQS, BACK_OFF_SEQS]
    assert [x.state.knobs.prefill_chunk_size for x in d] == [128, 64, 32, 32, 32]
    assert "SLO breached" in d[1].reason and "p99 ITL 130 ms" in d[1].reason


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


def test_itl_breach_with_ttft_near_its_slo_still_takes_the_chunk_first():
    """Backing off max_num_seqs would queue requests and push the TTFT that is already near its SLO over."""
    d = run([window(ttft=900, itl=130, running=6)] * 2)
    assert actions(d) == [HOLD, LOWER_CHUNK] and seqs(d) == [8, 8]
    assert d[-1].state.knobs.prefill_chunk_size == 64


def test_ttft_breach_without_queue_raises_chunk_up_to_the_token_budget():
    d = run([TTFT_OVER_NO_QUEUE] * 5)
    assert actions(d) == [HOLD, RAISE_CHUNK, RAISE_CHUNK, HOLD, HOLD]
    assert [x.state.knobs.prefill_chunk_size for x in d] == [128, 256, 512, 512, 512]
    assert d[-1].tuned.status == "False" and d[-1].tuned.reason == "BoundsReached"
    assert "raise_prefill_chunk_size" in d[-1].tuned.message
    # a chunk above the step's token budget cannot help: the budget caps the chunk's range
    capped = run([TTFT_OVER_NO_QUEUE] * 3, state=TunerState(START.replace(max_num_batched_tokens=200)))
    assert [x.state.knobs.prefill_chunk_size for x in capped] == [128, 200, 200]


def chunks(decisions):
    return [d.state.knobs.prefill_chunk_size for d in decisions]


@pytest.mark.parametrize("name, ttft, itl, start_chunk, want_chunk", [
    # a phase of long documents at a small chunk, nothing to decode: one step could at best bring 2.5 to 1.25
    ("TTFT 2.5x over, ITL with headroom: two steps", 2500, 40, 64, 256),
    ("TTFT severe, but one step reaches the headroom: one step", 1500, 40, 64, 128),
    ("ITL inside its SLO but not under the headroom: one step", 2500, 90, 64, 128),
    ("the token budget caps the jump", 2500, 40, 256, 512),
])
def test_a_ttft_far_over_raises_the_chunk_two_steps_at_once(name, ttft, itl, start_chunk, want_chunk):
    d = run([window(ttft=ttft, itl=itl)], state=TunerState(START.replace(prefill_chunk_size=start_chunk)))
    assert actions(d) == [RAISE_CHUNK] and chunks(d) == [want_chunk], d[0].reason


def test_a_jump_that_fails_is_undone_whole_and_then_one_step_is_tried():
    far = window(ttft=2500, itl=40)
    d = run([far, window(ttft=3000, itl=40), far, window(ttft=3000, itl=40), far],
            state=TunerState(START.replace(prefill_chunk_size=64)))
    assert actions(d) == [RAISE_CHUNK, ROLLBACK, RAISE_CHUNK, ROLLBACK, HOLD]
    assert chunks(d) == [256, 64, 128, 64, 64]
    assert d[-1].tuned.reason == "NoBetterSetting"


def test_a_backlog_counts_against_ttft_before_its_first_tokens_do():
    """Documents come faster than a small chunk lets them through: 12 wait while 4 finish a second, so
    the newest will wait 3 s at least, though the first tokens so far came in 500 ms."""
    building = dataclasses.replace(window(ttft=500, itl=40, waiting=12, running=3), request_rate=4)
    d = run([building], state=TunerState(START.replace(prefill_chunk_size=64)))
    assert actions(d) == [RAISE_CHUNK] and chunks(d) == [256]
    assert "backlog that takes 3000 ms to drain" in d[0].reason
    # a few requests waiting for the next step are no backlog: 3 drain in 600 ms at 5 a second
    assert actions(run([GOOD_BUSY])) == [RAISE_SEQS]


def no_decodes(ttft):
    """A window of documents with one-token answers: first tokens only, no inter-token gap at all."""
    return dataclasses.replace(window(ttft=ttft), itl_p99_s=None)


@pytest.mark.parametrize("name, obs, want_action", [
    ("documents, TTFT past half the headroom line: a step up", no_decodes(450), RAISE_CHUNK),
    ("... also inside the hysteresis band", no_decodes(900), RAISE_CHUNK),
    ("TTFT far from its SLO: nothing to gain", no_decodes(350), HOLD),
    # whether a window's prefill chunks met its decodes is chance: a low ITL does not say they will not
    ("chats decoding far under their ITL SLO", window(ttft=600, itl=20), HOLD),
    ("chats decoding, ITL the nearer to its SLO", window(ttft=450, itl=70), HOLD),
])
def test_with_the_slo_met_the_chunk_goes_up_when_prefill_is_the_work_near_its_slo(name, obs, want_action):
    d = run([obs])
    assert actions(d) == [want_action], d[0].reason
    assert chunks(d) == [256 if want_action == RAISE_CHUNK else 128]
    assert d[0].tuned.status == "True"


def test_the_chunk_climbs_to_its_bound_then_holds_and_comes_down_when_decodes_stall():
    """Raised while nothing decoded, the chunk goes back at once, in one move, when decodes return over
    their SLO; should they stay over there, the breach is confirmed and diagnosed as any other."""
    d = run([no_decodes(600)] * 3 + [ITL_OVER] * 3)
    assert actions(d) == [RAISE_CHUNK, RAISE_CHUNK, HOLD, LOWER_CHUNK, LOWER_CHUNK, LOWER_CHUNK]
    assert chunks(d) == [256, 512, 512, 128, 64, 32]
    assert "raised while decodes were absent or cheap: back to 128" in d[3].reason
    assert [x.state.chunk_before_cheap_raise for x in d] == [128, 128, 128, None, None, None]


@pytest.mark.parametrize("name, then, want_action, want_chunk", [
    ("decodes back over their SLO: back at once", ITL_OVER, LOWER_CHUNK, 128),
    ("decodes back within their SLO, in the band: nothing", window(ttft=500, itl=90), HOLD, 512),
    ("still nothing decoding: nothing", no_decodes(300), HOLD, 512),
])
def test_a_chunk_raised_while_nothing_decoded_goes_back_when_decodes_breach(name, then, want_action,
                                                                            want_chunk):
    d = run([no_decodes(600), no_decodes(600), no_decodes(300), then])
    assert actions(d)[-1] == want_action, d[-1].reason
    assert chunks(d)[-1] == want_chunk


def test_only_raises_the_decodes_did_not_pay_for_are_undone_when_they_return():
    # a TTFT cure made with chats decoding near their SLO was made knowing what it costs them: nothing to
    # undo when they breach, judge_last_change judges it
    d = run([window(ttft=1300, itl=40)] * 2)
    assert actions(d) == [HOLD, RAISE_CHUNK] and d[-1].state.chunk_before_cheap_raise is None
    # ... with the last decodes far under it (a phase of documents' onset), it is undone as one with none
    d = run([window(ttft=1300, itl=16), window(ttft=300, itl=50), ITL_OVER])
    assert actions(d) == [RAISE_CHUNK, HOLD, LOWER_CHUNK] and chunks(d) == [256, 256, 128]
    # ... and neither is a cure right before one the decodes did not pay for: both served the documents
    d = run([window(ttft=1300, itl=90)] * 2 + [no_decodes(1300), no_decodes(600), ITL_OVER])
    assert actions(d) == [HOLD, RAISE_CHUNK, RAISE_CHUNK, HOLD, LOWER_CHUNK]
    assert chunks(d) == [128, 256, 512, 512, 128]
    assert [x.state.chunk_before_cheap_raise for x in d] == [None, None, 128, 128, None]
    # a raise rolled back leaves nothing to undo
    d = run([no_decodes(600), no_decodes(1300)])
    assert actions(d) == [RAISE_CHUNK, ROLLBACK] and d[-1].state.chunk_before_cheap_raise is None


@pytest.mark.parametrize("name, windows, want_actions, want_chunks", [
    # 256 -> 128 for the chats, a raise back to 256 at the documents' onset with the last chats' decodes
    # far under their SLO; when the chats return, 128 is chunk_back_for_decodes' way back, and free
    ("raised with decodes cheap: the way back stays open", [window(ttft=1300, itl=16), no_decodes(300), ITL_OVER],
     [RAISE_CHUNK, HOLD, LOWER_CHUNK], [256, 256, 128]),
    # raised with chats decoding near their SLO: the return says 128 did not pay, and chunk_back_for_decodes has
    # nothing to undo; the ITL breach is confirmed over two windows, and with 128 blocked the chunk takes half
    # a step (176) before max_num_seqs would back off
    ("raised with decodes near their SLO: 128 is marked failed",
     [window(ttft=1300, itl=40)] * 2 + [no_decodes(300)] + [ITL_OVER] * 2,
     [HOLD, RAISE_CHUNK, HOLD, HOLD, LOWER_CHUNK], [128, 256, 256, 256, 176]),
])
def test_a_raise_with_decodes_cheap_leaves_the_way_back_to_its_chunk_open(name, windows, want_actions,
                                                                         want_chunks):
    at_128 = TunerState(START, recent_knobs=(START.replace(prefill_chunk_size=256),), previous_action=LOWER_CHUNK)
    d = run(windows, state=at_128)
    assert actions(d) == want_actions, d[-1].reason
    assert chunks(d) == want_chunks


def test_a_mild_ttft_breach_with_decodes_absent_or_cheap_is_acted_on_at_once():
    """With nothing to decode, or the last decodes far under their SLO, a larger chunk costs no decode that
    matters: waiting a window to confirm the breach would only let the queue grow (a tuner that waited lost
    4 s that way at a phase of documents, and 6 s with the last chats' p99 ITL at 0.2 of their SLO)."""
    assert actions(run([no_decodes(1200)])) == [RAISE_CHUNK]
    assert actions(run([window(ttft=1200, itl=30)])) == [RAISE_CHUNK]  # under half the headroom line (40)
    assert actions(run([window(ttft=1200, itl=40)])) == [HOLD]  # chats near it: the breach is confirmed first


def test_a_chunk_raised_on_headroom_that_breaks_the_slo_is_rolled_back_and_not_retried():
    d = run([no_decodes(600), no_decodes(1300), no_decodes(600), no_decodes(600)])
    assert actions(d) == [RAISE_CHUNK, ROLLBACK, HOLD, HOLD]
    assert chunks(d) == [256, 128, 128, 128]


@pytest.mark.parametrize("name, after, want_action, want_chunk", [
    # the queue built before the raise still shows in the window after it, served faster: kept, and the
    # breach (with nothing decoding) is acted on as any other, here by a further raise
    ("TTFT over with more throughput: a backlog draining", dataclasses.replace(no_decodes(1300), request_rate=6),
     RAISE_CHUNK, 512),
    ("TTFT over with no more throughput: rolled back", no_decodes(1300), ROLLBACK, 128),
    ("ITL over its SLO: rolled back", dataclasses.replace(window(ttft=700, itl=130), request_rate=6), ROLLBACK, 128),
])
def test_a_chunk_raised_on_headroom_is_judged_as_a_ttft_cure(name, after, want_action, want_chunk):
    """raise_chunk_for_prefill's raise meets a queue as it builds: judged as a move from a met SLO, a
    128 -> 256 raise was rolled back at a documents' onset on the window after it, which still held the documents
    queued before it."""
    d = run([no_decodes(900), after])
    assert actions(d) == [RAISE_CHUNK, want_action], d[-1].reason
    assert chunks(d)[-1] == want_chunk


def test_a_round_of_three_moves_back_to_where_it_started_marks_the_last_setting_failed():
    """128 -> 64 -> 32 (ITL room) and a two-step jump back to 128 (TTFT): 32 did not pay, so the next
    round stops above it instead of going round again."""
    at_32 = TunerState(START.replace(prefill_chunk_size=32), recent_knobs=(START.replace(prefill_chunk_size=128),
                       START.replace(prefill_chunk_size=64)), previous_action=LOWER_CHUNK)
    d = run([window(ttft=2500, itl=40)], state=at_32)
    assert actions(d) == [RAISE_CHUNK] and chunks(d) == [128]
    assert d[0].state.blocked_until(START.replace(prefill_chunk_size=32), 20.0) is not None
    # a move to a setting no recent change left teaches nothing
    fresh = run([window(ttft=2500, itl=40)], state=TunerState(START.replace(prefill_chunk_size=32)))
    assert fresh[0].state.blocked_until(START.replace(prefill_chunk_size=32), 20.0) is None


def test_both_over_at_the_lower_bounds_is_bounds_reached():
    d = run([window(ttft=3000, itl=400)] * 2, state=TunerState(START.replace(max_num_seqs=2, prefill_chunk_size=32)))
    assert actions(d) == [HOLD, HOLD]
    assert d[-1].tuned.status == "False" and d[-1].tuned.reason == "BoundsReached"


def test_both_over_with_ttft_the_farther_takes_a_larger_chunk_when_nothing_else_can_move():
    """A breach that outlasted a window is an overload first (a back-off, a smaller chunk); with both at
    their bounds and TTFT the farther over, the queue compounds while the tuner holds, so a larger chunk
    is tried (a tuner once held chunk 256 for 36 s this way while 512 was free). With ITL the
    farther over there is still no move: the bounds are reached."""
    at_bounds = TunerState(START.replace(max_num_seqs=2, prefill_chunk_size=32))
    d = run([BOTH_OVER, ONSET], state=at_bounds)
    assert actions(d) == [HOLD, RAISE_CHUNK] and chunks(d) == [32, 64], d[-1].reason
    d = run([BOTH_OVER, window(ttft=2500, itl=300)], state=at_bounds)
    assert actions(d) == [HOLD, HOLD] and d[-1].tuned.reason == "BoundsReached"


def test_both_over_with_ttft_severe_backs_off_once_the_chunk_is_at_its_bound():
    d = run([STALL, ONSET], state=TunerState(START.replace(prefill_chunk_size=512)))
    assert actions(d) == [HOLD, BACK_OFF_SEQS] and seqs(d) == [8, 4]


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


def test_a_smaller_chunk_is_not_blamed_for_the_itl_of_a_burst_of_prompts():
    worse = window(ttft=300, itl=160)
    d = run([ITL_OVER, ITL_OVER, worse])
    assert actions(d) == [HOLD, LOWER_CHUNK, ROLLBACK]
    assert "with no more prefill work" in d[2].reason
    # the same ITL while twice the prompt tokens are computed: the burst stalls decodes at any chunk
    burst = dataclasses.replace(worse, prompt_token_rate=2 * worse.prompt_token_rate)
    d = run([ITL_OVER, ITL_OVER, burst])
    assert actions(d) == [HOLD, LOWER_CHUNK, LOWER_CHUNK]
    assert d[-1].state.knobs.prefill_chunk_size == 32


@pytest.mark.parametrize("chunk, bounds, want", [
    (128, (32, 512), 96), (256, (32, 512), 176), (512, (32, 512), 368), (96, (32, 512), 64),
    (64, (64, 512), 64),  # at the bound: no step left
    (48, (16, 512), 32), (16, (1, 512), 16),  # never under 16
])
def test_half_a_chunk_step_is_a_multiple_of_16_inside_the_bounds(chunk, bounds, want):
    assert gentler_chunk(chunk, KnobBounds(*bounds), POLICY) == want


def test_a_failed_halving_takes_half_a_chunk_step_before_the_batch_backs_off():
    # decodes over their SLO, first tokens in time, 128 -> 64 failed lately (it broke TTFT): 96, and only once
    # that fails too (or is blocked: the next half step lands on 64) does max_num_seqs back off
    failed = mark_failed((), START.replace(prefill_chunk_size=64), 0.0, POLICY, LOWER_CHUNK, None)
    d = run([ITL_OVER, ITL_OVER, ITL_OVER], state=TunerState(START, failed=failed), start_time=10.0)
    assert actions(d) == [HOLD, LOWER_CHUNK, BACK_OFF_SEQS], d[-1].reason
    assert [x.state.knobs.prefill_chunk_size for x in d] == [128, 96, 96]
    assert d[-1].state.knobs.max_num_seqs < START.max_num_seqs


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
