"""The engine core: the scheduler, the KV block pool and the model runner, one step at a time.

    step():  schedule  ->  run the model  ->  update (append each sampled token, stop, free, report)

It deals in token ids only: text, detokenization and stop strings belong to the output processor on
the caller's side (in the same process for `LLMEngine`, in the server's process otherwise). A request
that finishes in a step gives its blocks back in that same step, so the next step can admit a waiting
request into them. Requests, aborts and knob changes may come from other threads; they take effect at
the next step. With prefix caching on, the blocks a step fills are findable from the moment it is
scheduled; a step that fails leaves them without their K/V, so the whole prefix cache is forgotten.
A request with structured output waits (others overtaking it) until its grammar compiled; each step it
samples in gets its token mask (grammar_manager.py: filled on another thread while the model runs, waited
for where the runner applies it), and its matcher advances on the token it was given.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from iterserve.common.wire import Knobs
from iterserve.server.engine.block_manager import BlockManager
from iterserve.server.engine.grammar_manager import GrammarManager
from iterserve.server.engine.knobs import LiveKnobs
from iterserve.server.engine.outputs import CoreOutput
from iterserve.server.engine.request import Request, RequestStatus
from iterserve.server.engine.scheduler import Scheduler, SchedulerOutput
from iterserve.server.engine.structured_output import check_schema
from iterserve.server.errors import InvalidRequestError

if TYPE_CHECKING:  # the engine does not import the runner: the runner is handed in
    from iterserve.server.runner.sampler import ModelRunnerOutput

logger = logging.getLogger("iterserve.engine")
_COMPILE_WAIT_S = 0.02  # an engine with nothing to run but compiling grammars checks on them this often


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
    num_prompt_tokens_computed: int = 0  # includes recomputation after preemption; cached tokens are not computed
    # prefix cache lookups at first admissions, in tokens: prompt tokens looked up, and found cached
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
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
                 knobs: Knobs, policy: str = "continuous", eos_token_ids=(),
                 enable_prefix_caching: bool = True, grammar: GrammarManager | None = None):
        """grammar: compiles and runs the grammars of structured output (None: a model without a tokenizer,
        whose requests cannot ask for it)."""
        if num_blocks * block_size < max_model_len:
            raise InvalidRequestError(
                "kv_cache_memory",
                f"the KV cache holds {num_blocks * block_size} tokens, fewer than max_model_len "
                f"{max_model_len}: give it more memory or lower max_model_len",
            )
        self.model_runner = model_runner
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.block_manager = BlockManager(num_blocks, block_size, enable_caching=enable_prefix_caching)
        self.knobs = LiveKnobs(knobs)
        self.grammar = grammar
        is_ready = None
        if grammar is not None:
            def is_ready(req: Request) -> bool:
                return req.sampling_params.structured_output is None or grammar.ready(req.request_id)
        self.scheduler = Scheduler(self.block_manager, self.knobs, policy, is_ready)
        self.stats = EngineStats()

    # -- requests (any thread) -------------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        """Queue a validated request; it joins the batch at a later step."""
        spec = req.sampling_params.structured_output
        if spec is not None:
            if self.grammar is None:  # the frontend refuses these; a request must never run unconstrained
                raise InvalidRequestError("structured_output", "this engine has no tokenizer to build grammars")
            self.grammar.add(req.request_id, spec)
        self.scheduler.add_request(req)

    def check_schema(self, schema: str, param: str) -> None:
        """Raise InvalidRequestError naming `param` unless the JSON schema makes a grammar: the server's
        requests are checked here, in the core's process, which has the grammar engine (the server does not
        import it); the grammar text is kept for the request's compile."""
        if self.grammar is None:
            raise InvalidRequestError(param, "this engine has no tokenizer to build grammars")
        check_schema(schema, param)

    def abort_request(self, request_id: str) -> None:
        """Stop a request; its blocks are freed at the next step, which reports it as aborted."""
        self.scheduler.abort_request(request_id)

    def update_knobs(self, **changes: int) -> Knobs:
        """Change max_num_seqs / max_num_batched_tokens / prefill_chunk_size from the next step on."""
        return self.knobs.update(**changes)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (between steps: the engine thread, or the core loop for another
        thread); returns how many blocks were findable."""
        return self.block_manager.reset_prefix_cache()

    def unfinished_request_ids(self) -> list[str]:
        return self.scheduler.unfinished_request_ids()

    # -- the loop (engine thread) ----------------------------------------------------------------

    def step(self) -> list[CoreOutput]:
        if self.grammar is not None and self.grammar.num_live:
            for request_id, reason in self.grammar.take_failures():
                logger.error("request %s: its grammar failed to compile (%s); aborting it", request_id, reason)
                self.abort_request(request_id)
        scheduler_output = self.scheduler.schedule()
        # checked after scheduling: a request added meanwhile (another thread) was counted before it could be
        grammar = self.grammar if self.grammar is not None and self.grammar.num_live else None
        if grammar is not None:
            # the aborted ones (finished ones freed theirs in _update): not every finished id, since a
            # request that finished in the last step may have been added again, its new grammar compiling
            grammar.free([r.request_id for r in self.scheduler.aborted])
            # starts the fill, which runs beside the forward pass below
            scheduler_output.grammar_bitmask = grammar.bitmask(
                [s.request_id for s in scheduler_output.scheduled
                 if s.sampling_params is not None and s.sampling_params.structured_output is not None])
            if scheduler_output.is_empty and not self.scheduler.aborted:
                grammar.wait_for_compiles(_COMPILE_WAIT_S)  # all that is left is compiling: do not spin
        try:
            runner_output = self.model_runner.execute_model(scheduler_output)
        except BaseException:
            self.block_manager.reset_prefix_cache()  # blocks registered for this step hold no K/V
            raise
        return self._update(scheduler_output, runner_output)

    def _update(self, out: SchedulerOutput, sampled) -> list[CoreOutput]:
        outputs = [_finished_output(r) for r in self.scheduler.aborted]
        grammar = self.grammar if out.grammar_bitmask is not None else None  # only this step's rows have one
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
            by_token = status is RequestStatus.FINISHED_STOPPED  # EOS or a stop token id
            if grammar is not None and grammar.accept(req.request_id, token) and status is None:
                status = RequestStatus.FINISHED_STOPPED  # the grammar reached its end state
            if status is not None:
                self.scheduler.finish_request(req, status)
                if grammar is not None:
                    grammar.free((req.request_id,))  # now, not at the next step: the engine may go idle
            outputs.append(CoreOutput(
                req.request_id, [token], req.finish_reason, req.stop_reason,
                None if logprob is None else [logprob], None if top is None else [top],
                req.num_preemptions, req.scheduled_time, req.first_token_time, req.finished_time,
                req.num_cached_tokens or 0, ended_by_stop_token=by_token))
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
        s.prefix_cache_queries = self.scheduler.prefix_cache_queries
        s.prefix_cache_hits = self.scheduler.prefix_cache_hits
        # slots in use that hold no token: the tails of the requests' last blocks (a shared block is full)
        bm = self.block_manager
        allocated = bm.num_allocated_slots()
        empty = sum(len(bm.block_tables.get(r.request_id, ())) * bm.block_size - r.num_computed_tokens
                    for r in self.scheduler.running)
        s.allocated_slot_steps += allocated
        s.filled_slot_steps += allocated - empty


def _finished_output(req: Request) -> CoreOutput:
    return CoreOutput(req.request_id, [], req.finish_reason, req.stop_reason, None, None, req.num_preemptions,
                      req.scheduled_time, req.first_token_time, req.finished_time, req.num_cached_tokens or 0)
