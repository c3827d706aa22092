"""A request's state inside the engine: its tokens, how many of them are computed, and its status.

As in vLLM v1 there is no prefill or decode phase: a request has `num_tokens` (prompt + output so far)
and `num_computed_tokens` (those whose K/V are in the cache). Each step computes some of the
difference. A fresh prefill, a chunked prefill, a recompute after preemption and a decode are all
"compute the next n tokens"; when the computed count reaches the total, the step also samples one.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from iterserve.server.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, its KV freed; it recomputes when readmitted
    FINISHED_STOPPED = "finished_stopped"  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = "finished_length"  # max_tokens or max_model_len
    FINISHED_ABORTED = "finished_aborted"  # the client went away

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASON.get(self)


_FINISHED = {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED}
_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}

# Ties in (priority, arrival) are broken by admission order, so sorting is total and stable.
_arrival_counter = itertools.count()


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: int = 0  # lower is served first, as in vLLM
    arrival_time: float = field(default_factory=time.monotonic)

    status: RequestStatus = RequestStatus.WAITING
    # prompt followed by every sampled token; the last one is not yet in the KV cache
    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    # prompt tokens found in the prefix cache at the first admission (None until then)
    num_cached_tokens: int | None = None
    # per-token logprob of each sampled token (only when sampling_params.logprobs is set)
    output_logprobs: list[float] = field(default_factory=list)
    # per sampled token, its top (token id, logprob) alternatives (only when top_logprobs is set)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    stop_reason: int | None = None  # the stop token id that ended it
    # timestamps (time.monotonic) for latency metrics
    scheduled_time: float | None = None  # first admitted to the running batch
    first_token_time: float | None = None
    finished_time: float | None = None
    # position in the waiting order: (priority, arrival sequence); kept across preemption so a
    # preempted request goes back ahead of everything that arrived after it
    sort_key: tuple[int, int] = field(init=False)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.sort_key = (self.priority, next(_arrival_counter))

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason

    def append_token(self, token_id: int, logprob: float | None = None,
                     top_logprobs: list[tuple[int, float]] | None = None) -> None:
        self.token_ids.append(token_id)
        if logprob is not None:
            self.output_logprobs.append(logprob)
        if top_logprobs is not None:
            self.output_top_logprobs.append(top_logprobs)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
