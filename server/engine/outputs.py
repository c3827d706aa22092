"""What the engine reports: `CoreOutput` per request and step from the engine core (token ids, no text),
and `RequestOutput`, the same request as a client sees it once the output processor has detokenized it.

CoreOutput crosses the process boundary between the engine core and the server inside a StepReport
(engine/messages.py; msgspec encodes dataclasses as they are). It stays a plain dataclass so that the
in-process engine (`LLMEngine`, the GPU benchmark's machines) needs neither msgspec nor ZeroMQ.
RequestOutput never leaves the process that made it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class CoreOutput:
    """One request's result of one step: the token it sampled, or how it finished."""

    request_id: str
    new_token_ids: list[int]  # empty when the request only finished (aborted)
    finish_reason: str | None = None  # "stop" (EOS or a stop token id) | "length" | "abort", once finished
    stop_reason: int | None = None  # the stop token id that ended it (stop strings are the frontend's)
    new_logprobs: list[float] | None = None  # when the request asked for logprobs
    new_top_logprobs: list[list[tuple[int, float]]] | None = None  # when it asked for top_logprobs
    num_preemptions: int = 0
    # time.monotonic() in the engine core (the clock is system-wide, so the frontend can compare)
    scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at the first admission
    # the last new token is the EOS or stop token id that ended the request: its text is left out of the
    # output, as vLLM does (the token stays in the token ids); not so when a grammar's end or length did
    ended_by_stop_token: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    # every output token: on the final output only (copying it each step would cost O(length));
    # while a request runs, new_token_ids carries each step's tokens
    token_ids: list[int]
    text: str  # the output text so far (a matched stop string excluded)
    new_token_ids: list[int]  # tokens since this request's previous output
    new_text: str  # text since this request's previous output
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort", once finished
    stop_reason: int | str | None  # the stop token id or stop string, when one ended it
    logprobs: list[float] | None  # per output token, when asked for (final output only, like token_ids)
    new_logprobs: list[float] | None  # logprobs of new_token_ids, when asked for
    # per token, its top_logprobs most likely (token id, logprob) pairs; full on the final output only
    top_logprobs: list[list[tuple[int, float]]] | None
    new_top_logprobs: list[list[tuple[int, float]]] | None
    num_preemptions: int
    num_cached_tokens: int  # prompt tokens found in the prefix cache (usage.prompt_tokens_details)
    arrival_time: float
    scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
