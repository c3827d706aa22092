"""The prefill chunk's own moves, apart from the breach cures: its range, how far a TTFT breach may raise
it (`chunk_steps`), the raise on prefill headroom with nothing decoding (`headroom_raise`, for the rule
`raise_chunk_for_prefill`) and the return of a chunk raised while decodes were absent or cheap once they
come back over their SLO (`decodes_back`, for `chunk_back_for_decodes`, with the chunk remembered by
`cheap_raise_base`). docs/tuning.md explains each."""

from __future__ import annotations

import math

from iterserve.common.wire import Knobs
from iterserve.operator.tuning.policy import KnobBounds, TuningPolicy
from iterserve.operator.tuning.reading import Reading


def chunk_bounds(knobs: Knobs, policy: TuningPolicy) -> KnobBounds:
    """A chunk above the step's token budget computes no more per step, so the budget caps the range."""
    b = policy.prefill_chunk_size_bounds
    return KnobBounds(b.min, max(b.min, min(b.max, knobs.max_num_batched_tokens)))


def chunk_steps(ttft: float, policy: TuningPolicy) -> int:
    """Chunk steps up (of chunk_factor each) a p99 TTFT at `ttft` of its SLO calls for: one, or two when one
    would not bring it under the headroom. A prompt's prefill takes prompt / chunk steps, so a queue of long
    prompts drains about as much faster as the chunk grows; each step costs a cooldown and a window, and one
    step at a time 64 -> 128 -> 256 at a phase of documents took 36 s and lost 13 of them. Never more
    than two, so a failed jump is undone before it costs much; and never down: ITL falls far less than the
    chunk (a step's fixed cost stays) while TTFT may rise as much."""
    needed = math.log(max(ttft, 1.0) / policy.headroom_line) / math.log(policy.chunk_factor)
    return 2 if needed > 1 else 1


def headroom_raise(k: Knobs, r: Reading, policy: TuningPolicy) -> Knobs | None:
    """One chunk step up while the SLO is met, when prefill is the work that comes near its SLO (TTFT past
    half the headroom line) and nothing decodes (no inter-token gap in the window: a phase of documents
    with one-token answers), so no decode pays for it. A queue of long prompts is met before it breaches
    TTFT: without this rule a phase of documents sat at chunk 128 for 50 s with p99 TTFT at 0.4-0.75
    of its SLO and no decodes, until a burst tipped it over. A window of chats with a low ITL is not
    enough: whether prefill chunks met decodes in it is chance, and in a phase of chats a raise on ITL at
    0.36 of its SLO broke it (0.36 -> 1.38) in the next window. None when the rule does not apply or the
    chunk is at its bound."""
    if r.ttft < policy.headroom_line / 2 or not r.nothing_decodes:
        return None
    larger = k.replace(prefill_chunk_size=chunk_bounds(k, policy).clamp(
        math.ceil(k.prefill_chunk_size * policy.chunk_factor)))
    return None if larger == k else larger


def decodes_cheap(r: Reading, policy: TuningPolicy) -> bool:
    """No decode, or none near its SLO (p99 ITL under half the headroom line), pays for a larger chunk."""
    return r.itl < policy.headroom_line / 2


def decodes_back(k: Knobs, before: int | None, r: Reading) -> Knobs | None:
    """The chunk `before` the raises made while decodes were absent or cheap (p99 ITL under half the
    headroom line), put back as soon as decodes return over their ITL SLO, without the second window
    `cure_breach` asks to confirm a breach: what justified the raise is gone. A phase of documents leaves the chunk
    large; the chats after it breach ITL in the windows a document's prefill falls in, and confirming that
    over separate windows took 26-120 s (10-15 chats lost each time), and 22 s where the raise was a TTFT
    cure at the documents' onset with the last chats' decodes at 0.16 of their SLO. None when no such raise stands or
    the decodes meet their SLO (a move
    from a met SLO would be rolled back on the next noisy window)."""
    if before is None or r.nothing_decodes or r.itl <= 1 or k.prefill_chunk_size <= before:
        return None
    return k.replace(prefill_chunk_size=before)


def cheap_raise_base(before: int | None, knobs: Knobs, target: Knobs, raised_cheaply: bool) -> int | None:
    """The chunk `before` the raises made while decodes were absent or cheap, after a move from `knobs` to
    `target`: set by the first such raise, kept through the next ones, forgotten once a move brings the
    chunk back to it or below."""
    if raised_cheaply:
        return knobs.prefill_chunk_size if before is None else before
    return None if before is None or target.prefill_chunk_size <= before else before
