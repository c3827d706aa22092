"""The engine core's token ids -> what a client sees: detokenized text, stop strings, RequestOutputs.

It runs where the client is (the server's process, or the offline `LLMEngine`), not in the engine
core, so detokenization stays off the core's critical path (vLLM v1 splits them the same way). The
core stops a request on EOS, a stop token id or length (the EOS or stop token's own text is left out,
as vLLM leaves it out); a stop string is found here, after
detokenizing: the text is cut before it, the request is reported finished at once, and its id is
returned so the caller aborts it in the core. While a request streams, the last few characters that
could still become a stop string are held back.
"""

from __future__ import annotations

import time

from iterserve.server.engine.outputs import CoreOutput, RequestOutput
from iterserve.server.engine.sampling_params import SamplingParams


class _RequestState:
    """One request's output so far and how much of it has been handed out."""

    def __init__(self, prompt_token_ids: list[int], params: SamplingParams, arrival_time: float, detokenizer):
        self.prompt_token_ids = prompt_token_ids
        self.arrival_time = arrival_time
        self.detokenizer = detokenizer
        self.stop = params.stop
        self.holdback = max((len(s) for s in params.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.logprobs: list[float] | None = [] if params.logprobs else None
        self.top_logprobs: list | None = [] if params.top_logprobs else None
        self.text = ""
        self.num_sent_chars = 0
        self.num_sent_tokens = 0


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _RequestState] = {}
        # finished here by a stop string, not yet reported aborted by the core: their ids stay taken
        self._aborting: set[str] = set()

    def has_request(self, request_id: str) -> bool:
        return request_id in self._states or request_id in self._aborting

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float) -> None:
        detok = None
        if self.tokenizer is not None:
            detok = self.tokenizer.incremental_detokenizer(prompt_token_ids,
                                                           skip_special_tokens=params.skip_special_tokens)
        self._states[request_id] = _RequestState(prompt_token_ids, params, arrival_time, detok)

    def remove_request(self, request_id: str) -> None:
        """Forget a request the engine core never took (refused there, or never sent)."""
        self._states.pop(request_id, None)

    def process(self, outputs: list[CoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """One step's core outputs -> RequestOutputs, and the ids finished here by a stop string,
        which the caller must abort in the engine core."""
        results: list[RequestOutput] = []
        to_abort: list[str] = []
        stop_reason: int | str | None  # the core's stop token id, or the stop string matched here
        for out in outputs:
            state = self._states.get(out.request_id)
            if state is None:  # finished here already (a stop string); this is the core's abort
                self._aborting.discard(out.request_id)
                continue
            finish_reason, stop_reason, finished_time = out.finish_reason, out.stop_reason, out.finished_time
            matched = self._append(state, out)
            if matched is not None and finish_reason in (None, "length"):
                if finish_reason is None:
                    to_abort.append(out.request_id)
                    self._aborting.add(out.request_id)
                    finished_time = time.monotonic()
                finish_reason, stop_reason = "stop", matched
            results.append(self._make_output(out, state, finish_reason, stop_reason, finished_time))
        return results, to_abort

    def _append(self, state: _RequestState, out: CoreOutput) -> str | None:
        """Record the step's tokens; returns the stop string they completed, if one."""
        state.token_ids.extend(out.new_token_ids)
        if state.logprobs is not None and out.new_logprobs:
            state.logprobs.extend(out.new_logprobs)
        if state.top_logprobs is not None and out.new_top_logprobs:
            state.top_logprobs.extend(out.new_top_logprobs)
        if state.detokenizer is None:
            return None
        # the EOS or stop token id that ended the request adds no text (vLLM's rule)
        shown = out.new_token_ids[:-1] if out.ended_by_stop_token else out.new_token_ids
        for token_id in shown:
            previous_len = len(state.text)
            state.text += state.detokenizer.step(token_id)
            for s in state.stop:
                # a new match must end inside the text this token added
                at = state.text.find(s, max(0, previous_len - len(s) + 1))
                if at >= 0:
                    state.text = state.text[:at]
                    return s
        return None

    def _make_output(self, out: CoreOutput, state: _RequestState, finish_reason, stop_reason,
                     finished_time) -> RequestOutput:
        finished = finish_reason is not None
        visible = len(state.text) if finished else max(state.num_sent_chars, len(state.text) - state.holdback)
        new_text = state.text[state.num_sent_chars : visible]
        state.num_sent_chars = visible
        sent = state.num_sent_tokens
        state.num_sent_tokens = len(state.token_ids)
        if finished:
            del self._states[out.request_id]
        return RequestOutput(
            request_id=out.request_id,
            prompt_token_ids=state.prompt_token_ids,
            token_ids=state.token_ids if finished else [],
            text=state.text,
            new_token_ids=state.token_ids[sent:],
            new_text=new_text,
            finished=finished,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            logprobs=state.logprobs if finished else None,
            new_logprobs=state.logprobs[sent:] if state.logprobs is not None else None,
            top_logprobs=state.top_logprobs if finished else None,
            new_top_logprobs=state.top_logprobs[sent:] if state.top_logprobs is not None else None,
            num_preemptions=out.num_preemptions,
            num_cached_tokens=out.num_cached_tokens,
            arrival_time=state.arrival_time,
            scheduled_time=out.scheduled_time,
            first_token_time=out.first_token_time,
            finished_time=finished_time,
        )
