"""The engine: owns the scheduler, the KV block pool and the model runner, and runs one step at a time.

    step():  schedule  ->  run the model  ->  postprocess (append tokens, stop, free, report)

A request that finishes in a step gives its blocks back in that same step, so the next step can admit
a waiting request into them. Requests, aborts and knob changes may come from other threads; they take
effect at the next step.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass

from iterserve.server.engine.block_manager import BlockManager
from iterserve.server.engine.knobs import LiveKnobs, SchedulerKnobs
from iterserve.server.engine.output_processor import OutputProcessor, RequestOutput
from iterserve.server.engine.request import Request
from iterserve.server.engine.sampling_params import InvalidRequestError, SamplingParams
from iterserve.server.engine.scheduler import Scheduler, SchedulerOutput


@dataclass
class EngineStats:
    num_steps: int = 0
    num_preemptions: int = 0
    num_generated_tokens: int = 0
    num_prompt_tokens_computed: int = 0  # includes recomputation after preemption
    # KV slots allocated and slots holding a token, summed over steps (after each forward pass)
    allocated_slot_steps: int = 0
    filled_slot_steps: int = 0

    @property
    def kv_waste(self) -> float:
        """Share of allocated KV slots that held no token, averaged over the steps run so far."""
        if not self.allocated_slot_steps:
            return 0.0
        return 1.0 - self.filled_slot_steps / self.allocated_slot_steps


class LLMEngine:
    def __init__(self, model_runner, *, tokenizer, max_model_len: int, num_blocks: int, block_size: int,
                 knobs: SchedulerKnobs, policy: str = "continuous", eos_token_ids=(), vocab_size: int):
        self.model_runner = model_runner
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        if num_blocks * block_size < max_model_len:
            raise InvalidRequestError(
                "kv_cache_memory",
                f"the KV cache holds {num_blocks * block_size} tokens, fewer than max_model_len "
                f"{max_model_len}: give it more memory or lower max_model_len",
            )
        self.block_manager = BlockManager(num_blocks, block_size)
        self.knobs = LiveKnobs(knobs)
        self.scheduler = Scheduler(self.block_manager, self.knobs, policy)
        self.output_processor = OutputProcessor(tokenizer, max_model_len)
        self.stats = EngineStats()
        self._enqueue_lock = threading.Lock()

    @classmethod
    def from_config(cls, config) -> "LLMEngine":
        from iterserve.server.engine.engine_factory import build_engine

        return build_engine(config)

    # -- requests (any thread) -------------------------------------------------------------------

    def add_request(self, prompt: str | None = None, sampling_params: SamplingParams | None = None, *,
                    prompt_token_ids: list[int] | None = None, request_id: str | None = None,
                    priority: int = 0) -> str:
        """Validate and queue a request; it joins the batch at a later step. Returns its id."""
        req = self.make_request(prompt, sampling_params, prompt_token_ids=prompt_token_ids,
                                request_id=request_id, priority=priority)
        self.enqueue(req)
        return req.request_id

    def make_request(self, prompt: str | None = None, sampling_params: SamplingParams | None = None, *,
                     prompt_token_ids: list[int] | None = None, request_id: str | None = None,
                     priority: int = 0) -> Request:
        """Validate a request without queueing it (raises InvalidRequestError naming the field)."""
        params = sampling_params or SamplingParams()
        ids = self._prompt_ids(prompt, prompt_token_ids)
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                "prompt", f"the prompt has {len(ids)} tokens; max_model_len is {self.max_model_len}, "
                "which leaves no room to generate"
            )
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop", "stop strings need a tokenizer; this model has none")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidRequestError("priority", f"must be an integer, got {priority!r}")
        req = Request(
            request_id=request_id or uuid.uuid4().hex,
            prompt_token_ids=ids,
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            priority=priority,
        )
        return req

    def enqueue(self, req: Request) -> None:
        """Queue a validated request. Its id must not belong to a request still in the engine (one
        aborted but not yet reported counts): ids key the block tables and the output state."""
        with self._enqueue_lock:
            if self.output_processor.has_request(req.request_id):
                raise InvalidRequestError("request_id", f"{req.request_id!r} is already in use")
            self.output_processor.add_request(req)
        self.scheduler.add_request(req)

    def abort_request(self, request_id: str) -> None:
        """Stop a request (its client went away); its blocks are freed at the next step."""
        self.scheduler.abort_request(request_id)

    def update_knobs(self, **changes: int) -> SchedulerKnobs:
        """Change max_num_seqs / max_num_batched_tokens / prefill_chunk_size from the next step on."""
        return self.knobs.update(**changes)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # -- the loop (engine thread) ----------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        scheduler_output = self.scheduler.schedule()
        sampled = self.model_runner.execute_model(scheduler_output) if not scheduler_output.is_empty else None
        return self._postprocess(scheduler_output, sampled)

    def _postprocess(self, out: SchedulerOutput, sampled) -> list[RequestOutput]:
        outputs = [self.output_processor.make_output(r) for r in out.aborted_requests]
        j = 0
        for req, n in zip(out.scheduled_requests, out.num_scheduled_tokens):
            req.num_computed_tokens += n
            if req.num_computed_tokens < req.num_tokens:
                continue  # a prompt chunk that does not reach the end samples nothing
            status = self.output_processor.append_token(req, sampled.token_ids[j], sampled.logprobs[j],
                                                        sampled.top_logprobs[j])
            j += 1
            if req.first_token_time is None:
                req.first_token_time = time.monotonic()
            if status is not None:
                self.scheduler.finish_request(req, status)
            outputs.append(self.output_processor.make_output(req))
        self._record_stats(out, j)
        return outputs

    def _record_stats(self, out: SchedulerOutput, num_sampled: int) -> None:
        s = self.stats
        s.num_steps += 1
        s.num_preemptions = self.scheduler.num_preemptions
        s.num_generated_tokens += num_sampled
        s.num_prompt_tokens_computed += out.total_num_scheduled_tokens - num_sampled
        s.allocated_slot_steps += self.block_manager.num_allocated_slots()
        s.filled_slot_steps += sum(r.num_computed_tokens for r in self.scheduler.running)

    # -- helpers ---------------------------------------------------------------------------------

    def _prompt_ids(self, prompt, prompt_token_ids) -> list[int]:
        if prompt_token_ids is None:
            if not isinstance(prompt, str):
                raise InvalidRequestError("prompt", f"must be a string or token ids, got {type(prompt).__name__}")
            if not prompt:
                raise InvalidRequestError("prompt", "must not be empty")
            if self.tokenizer is None:
                raise InvalidRequestError("prompt", "this model has no tokenizer: pass prompt_token_ids")
            prompt_token_ids = self.tokenizer.encode(prompt)
        ids = list(prompt_token_ids)
        if not ids:
            raise InvalidRequestError("prompt", "must not be empty")
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise InvalidRequestError("prompt", f"token id {t!r} is outside the vocabulary [0, {self.vocab_size})")
        return ids
