"""`Reading`: one window's observation measured against the policy, the figures `decide` reasons on, and the
count of recent breaches that confirms one (`count_breach`)."""

from __future__ import annotations

from dataclasses import dataclass

from iterserve.operator.tuning.observation import Observation
from iterserve.operator.tuning.policy import TuningPolicy


@dataclass(frozen=True)
class Reading:
    """An observation measured against the policy."""

    ttft: float  # p99 / SLO (0 when there was nothing to measure)
    itl: float
    score: float  # the worse of the two
    trouble: str | None  # preemptions or failed steps, described
    text: str  # the figures, for reasons
    obs_request_rate: float
    obs_prompt_token_rate: float
    mix: float | None  # prompt tokens per finished request: what a failure is remembered with

    @property
    def met(self) -> bool:
        return self.score <= 1

    @property
    def nothing_decodes(self) -> bool:
        """No inter-token gap in the window (documents with one-token answers): no decode pays for a
        larger chunk."""
        return self.itl == 0


def read(obs: Observation, policy: TuningPolicy) -> Reading:
    # a backlog reaches the TTFT histogram only as its requests get their first token, a window or more
    # late; the time the queue takes to drain (Little's law: requests waiting / requests finishing per
    # second) is what the newest of them will wait at least, and it shows while the backlog builds
    backlog_s = obs.queued / obs.request_rate if obs.request_rate > 0 else 0.0
    ttft = max(obs.ttft_p99_s or 0.0, backlog_s) * 1000 / policy.ttft_p99_ms
    itl = (obs.itl_p99_s or 0.0) * 1000 / policy.itl_p99_ms
    trouble = None
    if obs.preemption_rate > policy.max_preemption_rate:
        trouble = f"{obs.preemption_rate:.2f} preemptions/s with KV usage at {obs.kv_usage:.0%}"
    elif obs.error_rate > policy.max_error_rate:
        trouble = f"{obs.error_rate:.2f} errors/s (failed engine steps and 5xx answers)"
    drain = ""
    if backlog_s > (obs.ttft_p99_s or 0.0):
        drain = f" with a backlog that takes {backlog_s * 1000:.0f} ms to drain"
    text = (f"p99 TTFT {_ms(obs.ttft_p99_s)}{drain} (SLO {policy.ttft_p99_ms:g} ms), p99 ITL {_ms(obs.itl_p99_s)} "
            f"(SLO {policy.itl_p99_ms:g} ms), KV {obs.kv_usage:.0%}, {obs.queued:.1f} waiting, "
            f"{obs.num_samples} samples")
    return Reading(ttft, itl, max(ttft, itl), trouble, text, obs.request_rate, obs.prompt_token_rate,
                    obs.prompt_tokens_per_request)


def count_breach(num: int, last_end: float | None, over: bool, obs: Observation,
                 policy: TuningPolicy) -> tuple[int, float | None]:
    """The recent breaches of one p99 after this window: (count, end of the last window counted). A
    window that overlaps the last one counted adds nothing: with ticks closer than a window (the default
    ticks every 30 s over 60 s windows) two windows share samples, and one stall in the shared part would
    confirm itself. Half an interval of slack absorbs the ticks' jitter. The count lapses only once a
    window that starts more than a window after the last one counted meets the SLO: one clean window
    between two breaches does not clear them. A p99 over a short window swings with whether a long
    prompt's prefill fell in it; chats at chunk 256 once breached ITL in about every
    other window for 100 s (the clean ones at 100-130 ms against 350), and a count that each clean window
    reset never reached two."""
    if last_end is not None and obs.start - last_end > policy.window_s:
        num, last_end = 0, None
    if not over:
        return num, last_end
    if last_end is None or obs.start >= last_end - policy.interval_s / 2:
        return num + 1, obs.end
    return num, last_end


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.0f} ms"
