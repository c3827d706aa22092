"""`Observation`: what one sliding window of a service's pods measured, whichever source read it
(pods' /metrics directly, or Prometheus), and the metric names both sources read (docs/metrics.md)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from iterserve.common.wire import (  # noqa: F401  (the tuner's readers import the names from here)
    GENERATION_TOKENS,
    HTTP_RESPONSES,
    INFERENCE_TIME,
    ITL,
    KV_USAGE,
    PREEMPTIONS,
    PROMPT_TOKENS,
    QUEUE_TIME,
    REQUESTS,
    RUNNING,
    STEP_FAILURES,
    TTFT,
    WAITING,
)

HISTOGRAMS = (TTFT, ITL, QUEUE_TIME, INFERENCE_TIME)

SERVER_ERRORS = "5xx"  # this module's name for the sum of HTTP_RESPONSES{code=~"5.."}
COUNTERS = (REQUESTS, PROMPT_TOKENS, GENERATION_TOKENS, PREEMPTIONS, STEP_FAILURES, SERVER_ERRORS)

GAUGES = (WAITING, RUNNING, KV_USAGE)


@dataclass(frozen=True)
class Observation:
    start: float  # the window, in the tuner's clock (seconds)
    end: float
    num_pods: int  # pods that contributed
    num_samples: int  # first tokens (TTFT observations) in the window: what min_samples counts
    ttft_p99_s: float | None  # None: no observation in the window
    itl_p99_s: float | None
    request_rate: float  # finished requests per second, all pods
    prompt_token_rate: float
    generation_token_rate: float
    waiting: float  # time-average of requests waiting, summed over pods
    running: float  # time-average of requests running, summed over pods
    queue_time_mean_s: float | None  # mean arrival-to-admission time of finished requests
    kv_usage: float  # highest per-pod average KV usage (0..1): pressure on any pod counts
    preemption_rate: float  # preemptions per second, all pods
    # failed engine steps plus 5xx answers per second, all pods (a 429 is not an error here: it says the
    # queue is full, which calls for more capacity, not a back-off)
    error_rate: float
    errors: tuple[str, ...] = ()  # pods that could not be read, with why
    inference_time_mean_s: float | None = None  # mean time finished requests spent in the batch

    @classmethod
    def empty(cls, now: float, errors: Sequence[str] = ()) -> Observation:
        """A window in which no pod could be read: no samples, so it decides nothing."""
        return cls(start=now, end=now, num_pods=0, num_samples=0, ttft_p99_s=None, itl_p99_s=None,
                   request_rate=0.0, prompt_token_rate=0.0, generation_token_rate=0.0, waiting=0.0, running=0.0,
                   queue_time_mean_s=None, kv_usage=0.0, preemption_rate=0.0, error_rate=0.0, errors=tuple(errors))

    @property
    def window_s(self) -> float:
        return self.end - self.start

    @property
    def prompt_tokens_per_request(self) -> float | None:
        """Prefill tokens computed per finished request: the load's mix (long documents or short chats),
        which decides what a knob does; None when no request finished."""
        return self.prompt_token_rate / self.request_rate if self.request_rate > 0 else None

    @property
    def in_batch(self) -> float:
        """Mean requests running: the gauge's average, or by Little's law (completion rate x mean time in
        the batch) when that says more. The gauge, read at a few scrapes, can fall in the step between one
        request's end and the next's start: at max_num_seqs 1 one such reading of two halves it."""
        little = self.request_rate * self.inference_time_mean_s if self.inference_time_mean_s is not None else 0.0
        return max(self.running, little)

    @property
    def queued(self) -> float:
        """Mean requests waiting: the gauge's average, or by Little's law (arrival rate x mean queue time)
        when that says more; the law holds between scrapes, where a gauge read twice can miss a queue."""
        little = self.request_rate * self.queue_time_mean_s if self.queue_time_mean_s is not None else 0.0
        return max(self.waiting, little)


class MetricsSource(Protocol):
    def observe(self, pod_urls: Sequence[str], now: float, window_s: float,
                since: float | None = None) -> Observation | None:
        """The window ending at `now`, `window_s` long but never reaching back to `since` (the last knob
        change) or before; None when nothing could be read."""

    def snapshot(self, pod_urls: Sequence[str], now: float) -> object:  # what it returns is not used
        """Called right after a change: a source that keeps its own history records a starting point."""
