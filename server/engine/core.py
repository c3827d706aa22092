"""The engine core: the scheduler, the KV block pool and the model runner, one step at a time.

    step():  schedule  ->  run the model  ->  update (append each sampled token, stop, free, report)

It deals in token ids only: text, detokenization and stop strings belong to the output processor on
the caller's side (in the same process for `LLMEngine`, in the server's process otherwise). A request
that finishes in a step gives its blocks back in that same step, so the next step can admit a waiting
request into them. Requests, aborts and knob changes may come from other threads; they take effect at
the next step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from iterserve.server.engine.block_manager import BlockManager
from iterserve.server.engine.knobs import LiveKnobs, SchedulerKnobs
from iterserve.server.engine.outputs import CoreOutput
from iterserve.server.engine.request import Request, RequestStatus
from iterserve.server.errors import InvalidRequestError
from iterserve.server.engine.scheduler import Scheduler, SchedulerOutput

if TYPE_CHECKING:  # the engine does not import the runner: the runner is handed in
    from iterserve.server.runner.sampler import ModelRunnerOutput


class Runner(Protocol):
    """What the engine core needs of a model runner (ModelRunner, NullModelRunner): one step's data-only
    SchedulerOutput in; the token (and logprobs) of every request the scheduler marked to sample out,
    keyed by request id."""

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput: ...


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


class EngineCore:
    def __init__(self, model_runner: Runner, *, max_model_len: int, num_blocks: int, block_size: int,
                 knobs: SchedulerKnobs, policy: str = "continuous", eos_token_ids=()):
        if num_blocks * block_size < max_model_len:
            raise InvalidRequestError(
                "kv_cache_memory",
                f"the KV cache holds {num_blocks * block_size} tokens, fewer than max_model_len "
                f"{max_model_len}: give it more memory or lower max_model_len",
            )
        self.model_runner = model_runner
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.block_manager = BlockManager(num_blocks, block_size)
        self.knobs = LiveKnobs(knobs)
        self.scheduler = Scheduler(self.block_manager, self.knobs, policy)
        self.stats = EngineStats()

    # -- requests (any thread) -------------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        """Queue a validated request; it joins the batch at a later step."""
        self.scheduler.add_request(req)

    def abort_request(self, request_id: str) -> None:
        """Stop a request; its blocks are freed at the next step, which reports it as aborted."""
        self.scheduler.abort_request(request_id)

    def update_knobs(self, **changes: int) -> SchedulerKnobs:
        """Change max_num_seqs / max_num_batched_tokens / prefill_chunk_size from the next step on."""
        return self.knobs.update(**changes)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def unfinished_request_ids(self) -> list[str]:
        return self.scheduler.unfinished_request_ids()

    # -- the loop (engine thread) ----------------------------------------------------------------

    def step(self) -> list[CoreOutput]:
        scheduler_output = self.scheduler.schedule()
        runner_output = self.model_runner.execute_model(scheduler_output)
        return self._update(scheduler_output, runner_output)

    def _update(self, out: SchedulerOutput, sampled) -> list[CoreOutput]:
        outputs = [_finished_output(r) for r in self.scheduler.aborted]
        num_sampled = 0
        for s in out.scheduled:
            if s.sampling_params is None:
                continue  # a prompt chunk that does not reach the end samples nothing
            req = self.scheduler.get(s.request_id)
            token = sampled.token_ids[s.request_id]
            logprob = sampled.logprobs.get(s.request_id)
            top = sampled.top_logprobs.get(s.request_id)
            req.append_token(token, logprob, top)
            num_sampled += 1
            if req.first_token_time is None:
                req.first_token_time = time.monotonic()
            status = self._stop_status(req, token)
            if status is not None:
                self.scheduler.finish_request(req, status)
            outputs.append(CoreOutput(
                req.request_id, [token], req.finish_reason, req.stop_reason,
                None if logprob is None else [logprob], None if top is None else [top],
                req.num_preemptions, req.scheduled_time, req.first_token_time, req.finished_time))
        self._record_stats(out, num_sampled)
        return outputs

    def _stop_status(self, req: Request, token_id: int) -> RequestStatus | None:
        """Stops in the order vLLM checks them: EOS (unless ignore_eos), a stop token id, then length."""
        params = req.sampling_params
        if not params.ignore_eos and token_id in self.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if token_id in params.stop_token_ids:
            req.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= params.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _record_stats(self, out: SchedulerOutput, num_sampled: int) -> None:
        s = self.stats
        s.num_steps += 1
        s.num_preemptions = self.scheduler.num_preemptions
        s.num_generated_tokens += num_sampled
        s.num_prompt_tokens_computed += out.total_num_scheduled_tokens - num_sampled
        s.allocated_slot_steps += self.block_manager.num_allocated_slots()
        s.filled_slot_steps += sum(r.num_computed_tokens for r in self.scheduler.running)


def _finished_output(req: Request) -> CoreOutput:
    return CoreOutput(req.request_id, [], req.finish_reason, req.stop_reason, None, None, req.num_preemptions,
                      req.scheduled_time, req.first_token_time, req.finished_time)
