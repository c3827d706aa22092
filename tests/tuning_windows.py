"""The tuner's windows as the decide() tests write them: a policy and starting knobs, `window()` and the
named windows built with it, and `run()`, which feeds windows one interval apart and returns the decisions."""

from __future__ import annotations

import dataclasses

from iterserve.common.wire import Knobs
from iterserve.operator.tuning.decide import TunerState, decide
from iterserve.operator.tuning.observation import Observation
from iterserve.operator.tuning.policy import TuningPolicy

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


def chunks(decisions):
    return [d.state.knobs.prefill_chunk_size for d in decisions]


def no_decodes(ttft):
    """A window of documents with one-token answers: first tokens only, no inter-token gap at all."""
    return dataclasses.replace(window(ttft=ttft), itl_p99_s=None)
