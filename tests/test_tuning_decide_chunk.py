"""decide() and the prefill chunk: lowered for ITL, raised for TTFT (two steps when far over, to the token
budget), raised while decodes were absent or cheap and taken back when they return, half steps after a failed
halving, rolled back when a raise breaks the SLO; the windows and `run()` are tests/tuning_windows.py's."""

from __future__ import annotations

import dataclasses

import pytest

from iterserve.operator.tuning.corrections import gentler_chunk
from iterserve.operator.tuning.decide import (
    BACK_OFF_SEQS,
    HOLD,
    LOWER_CHUNK,
    RAISE_CHUNK,
    RAISE_SEQS,
    ROLLBACK,
    TunerState,
)
from iterserve.operator.tuning.failures import mark_failed
from iterserve.operator.tuning.policy import KnobBounds
from tests.tuning_windows import (
    BOTH_OVER,
    GOOD_BUSY,
    ITL_OVER,
    ONSET,
    POLICY,
    STALL,
    START,
    TTFT_OVER_NO_QUEUE,
    actions,
    chunks,
    no_decodes,
    run,
    seqs,
    window,
)


def test_itl_breach_with_ttft_headroom_lowers_chunk_then_backs_off_at_its_bound():
    d = run([ITL_OVER] * 5)
    assert actions(d) == [HOLD, LOWER_CHUNK, LOWER_CHUNK, BACK_OFF_SEQS, BACK_OFF_SEQS]
    assert [x.state.knobs.prefill_chunk_size for x in d] == [128, 64, 32, 32, 32]
    assert "SLO breached" in d[1].reason and "p99 ITL 130 ms" in d[1].reason


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
