"""`LLMEngine`: the engine core and its output processor in one process, for offline use and tests.

    step():  core.step() (schedule -> run -> update, token ids)  ->  output processor (text, stop strings)

The server runs the same two pieces in two processes instead (engine/core_client.py); this class is
the in-process pairing, in the shape of vLLM's LLMEngine. Requests, aborts and knob changes may come
from other threads; they take effect at the next step.
"""

from __future__ import annotations

import threading

from iterserve.common.wire import Knobs
from iterserve.server.engine.core import EngineCore
from iterserve.server.engine.grammar_manager import GrammarManager
from iterserve.server.engine.input_processor import InputProcessor
from iterserve.server.engine.output_processor import OutputProcessor
from iterserve.server.engine.outputs import RequestOutput
from iterserve.server.engine.request import Request
from iterserve.server.engine.sampling_params import SamplingParams
from iterserve.server.errors import InvalidRequestError


class LLMEngine:
    kv_cache_report: str = ""  # set by engine_factory.build_engine: the KV cache's size, for the log

    def __init__(self, model_runner, *, tokenizer, max_model_len: int, num_blocks: int, block_size: int,
                 knobs: Knobs, policy: str = "continuous", eos_token_ids=(), vocab_size: int,
                 enable_prefix_caching: bool = True):
        core = EngineCore(model_runner, max_model_len=max_model_len, num_blocks=num_blocks, block_size=block_size,
                          knobs=knobs, policy=policy, eos_token_ids=eos_token_ids,
                          enable_prefix_caching=enable_prefix_caching,
                          grammar=None if tokenizer is None else GrammarManager(tokenizer, vocab_size, eos_token_ids))
        self._wrap(core, tokenizer, vocab_size)

    @classmethod
    def from_core(cls, core: EngineCore, tokenizer, vocab_size: int) -> LLMEngine:
        engine = cls.__new__(cls)
        engine._wrap(core, tokenizer, vocab_size)
        return engine

    def _wrap(self, core: EngineCore, tokenizer, vocab_size: int) -> None:
        self.core = core
        self.tokenizer = tokenizer
        self.max_model_len = core.max_model_len
        self.vocab_size = vocab_size
        # the core is in this process, grammar engine included: schemas are checked with the rest
        self.input_processor = InputProcessor(tokenizer, core.max_model_len, vocab_size, check_schemas=True)
        self.output_processor = OutputProcessor(tokenizer)
        self._enqueue_lock = threading.Lock()

    # the core's parts, for metrics, benchmarks and tests
    model_runner = property(lambda self: self.core.model_runner)
    scheduler = property(lambda self: self.core.scheduler)
    block_manager = property(lambda self: self.core.block_manager)
    knobs = property(lambda self: self.core.knobs)
    stats = property(lambda self: self.core.stats)

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
        return self.input_processor.make_request(prompt, sampling_params, prompt_token_ids=prompt_token_ids,
                                                 request_id=request_id, priority=priority)

    def enqueue(self, req: Request) -> None:
        """Queue a validated request. Its id must not belong to a request still in the engine (one
        aborted but not yet reported counts): ids key the block tables and the output state."""
        with self._enqueue_lock:
            if self.output_processor.has_request(req.request_id):
                raise InvalidRequestError("request_id", f"{req.request_id!r} is already in use")
            self.output_processor.add_request(req.request_id, req.prompt_token_ids, req.sampling_params,
                                              req.arrival_time)
        self.core.add_request(req)

    def abort_request(self, request_id: str) -> None:
        """Stop a request (its client went away); its blocks are freed at the next step."""
        self.core.abort_request(request_id)

    def update_knobs(self, **changes: int) -> Knobs:
        """Change max_num_seqs / max_num_batched_tokens / prefill_chunk_size from the next step on."""
        return self.core.update_knobs(**changes)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix; call it between steps (the thread that steps). Returns how many
        blocks were findable."""
        return self.core.reset_prefix_cache()

    # -- the loop (engine thread) ----------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        outputs, stopped = self.output_processor.process(self.core.step())
        for request_id in stopped:  # finished by a stop string: the core frees it at the next step
            self.core.abort_request(request_id)
        return outputs
