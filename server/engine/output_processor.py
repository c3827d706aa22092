"""After each forward pass: append sampled tokens, detokenize, detect stops, build RequestOutputs.

Stops are checked in the order vLLM uses: EOS (unless ignore_eos), a stop token id, then length
(max_tokens, max_model_len); stop strings after detokenizing. A stop string is cut from the text, and
while a request streams, the last few characters that could still become a stop string are held back.
"""

from __future__ import annotations

from dataclasses import dataclass

from iterserve.server.engine.request import Request, RequestStatus


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
    arrival_time: float
    scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None


class _TextState:
    """Detokenized text of one request and how much of it has been handed out."""

    def __init__(self, detokenizer, stop: list[str]):
        self.detokenizer = detokenizer
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.num_sent_chars = 0
        self.num_sent_tokens = 0


class OutputProcessor:
    def __init__(self, tokenizer, max_model_len: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self._states: dict[str, _TextState] = {}

    def has_request(self, request_id: str) -> bool:
        return request_id in self._states

    def add_request(self, req: Request) -> None:
        detok = None
        if self.tokenizer is not None:
            detok = self.tokenizer.incremental_detokenizer(
                req.prompt_token_ids, skip_special_tokens=req.sampling_params.skip_special_tokens
            )
        self._states[req.request_id] = _TextState(detok, req.sampling_params.stop)

    def append_token(self, req: Request, token_id: int, logprob: float | None,
                     top_logprobs: list[tuple[int, float]] | None = None) -> RequestStatus | None:
        """Record a sampled token; returns the finished status when it ends the request."""
        req.append_token(token_id, logprob, top_logprobs)
        params = req.sampling_params
        state = self._states[req.request_id]
        previous_len = len(state.text)
        if state.detokenizer is not None:
            state.text += state.detokenizer.step(token_id)
        if not params.ignore_eos and token_id in req.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if token_id in params.stop_token_ids:
            req.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        for s in state.stop:
            # a new match must end inside the text this token added
            at = state.text.find(s, max(0, previous_len - len(s) + 1))
            if at >= 0:
                state.text = state.text[:at]
                req.stop_reason = s
                return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= params.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def make_output(self, req: Request) -> RequestOutput:
        state = self._states[req.request_id]
        finished = req.is_finished
        visible = len(state.text) if finished else max(state.num_sent_chars, len(state.text) - state.holdback)
        new_text = state.text[state.num_sent_chars : visible]
        state.num_sent_chars = visible
        sent = state.num_sent_tokens
        new_ids = req.token_ids[req.num_prompt_tokens + sent :]
        state.num_sent_tokens += len(new_ids)
        want_logprobs = req.sampling_params.logprobs
        want_top = req.sampling_params.top_logprobs > 0
        if finished:
            del self._states[req.request_id]
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            token_ids=req.output_token_ids if finished else [],
            text=state.text,
            new_token_ids=new_ids,
            new_text=new_text,
            finished=finished,
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
            logprobs=list(req.output_logprobs) if finished and want_logprobs else None,
            new_logprobs=req.output_logprobs[sent:] if want_logprobs else None,
            top_logprobs=list(req.output_top_logprobs) if finished and want_top else None,
            new_top_logprobs=req.output_top_logprobs[sent:] if want_top else None,
            num_preemptions=req.num_preemptions,
            arrival_time=req.arrival_time,
            scheduled_time=req.scheduled_time,
            first_token_time=req.first_token_time,
            finished_time=req.finished_time,
        )
