"""The scheduler tests' shared parts: engines on the KVTraceRunner (tests/kv_trace_runner.py), the
reference output every request must get, and the records the state machine keeps
(tests/test_scheduler_properties.py, tests/scheduler_checks.py, tests/test_scheduler_cases.py)."""

from __future__ import annotations

import dataclasses

from iterserve.common.wire import Knobs
from iterserve.server.engine.llm_engine import LLMEngine
from iterserve.server.engine.sampling_params import SamplingParams
from tests.kv_trace_runner import VOCAB, KVTraceRunner
from tests.kv_trace_runner import next_token as _trace_next_token

KNOB_NAMES = tuple(f.name for f in dataclasses.fields(Knobs))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_token(tokens: list[int]) -> int:
    """The KVTraceRunner's next token after `tokens` (prompt + output so far)."""
    return _trace_next_token(tokens)


def reference_output(prompt: list[int], max_tokens: int, max_model_len: int) -> list[int]:
    tokens = list(prompt)
    out: list[int] = []
    while True:
        t = next_token(tokens)
        tokens.append(t)
        out.append(t)
        if len(out) >= max_tokens or len(tokens) >= max_model_len:
            return out


def make_engine(*, policy: str, block_size: int, num_blocks: int, max_model_len: int, knobs: Knobs,
                prepare_inputs: bool = True, enable_prefix_caching: bool = True) -> LLMEngine:
    return LLMEngine(
        KVTraceRunner(block_size=block_size, vocab_size=VOCAB, prepare_inputs=prepare_inputs),
        tokenizer=None, max_model_len=max_model_len, num_blocks=num_blocks, block_size=block_size,
        knobs=knobs, policy=policy, eos_token_ids=(), vocab_size=VOCAB, enable_prefix_caching=enable_prefix_caching,
    )


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def make_prompt(length: int, seed: int) -> list[int]:
    return [(seed + 7 * i * i + 3 * i) % VOCAB for i in range(length)]


@dataclasses.dataclass
class Tracked:
    """The test's own model of one request."""

    rid: str
    prompt: list[int]
    max_tokens: int
    priority: int
    outputs: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    abort_requested: bool = False  # aborted while still unfinished (from the test's point of view)
    num_finished_outputs: int = 0
    num_cached: int | None = None  # prompt tokens found cached at its first admission

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class Captured:
    """What the wrapped Scheduler.schedule() saw and returned, recorded before the step runs."""

    out: object  # the SchedulerOutput: data only, keyed by request id
    pre_running: list  # running requests before schedule(), aborts not yet drained
    pre_new: list  # requests still in the inbox before schedule()
    pre_waiting: list
    scheduled: list  # the Request behind each of out.scheduled
    num_scheduled: list[int]  # tokens each scheduled request computes this step
    computed_before: list[int]  # num_computed_tokens of each scheduled request, before the step
    num_tokens_before: list[int]
    table_lens: list[int]
    tables_are_the_block_managers: bool  # each ScheduledRequest.block_table as the block manager holds it
    aborted: list  # the requests schedule() found aborted
    preempted: list  # the requests schedule() preempted
    running_after: list
    waiting_after: list


def eng_hits(eng) -> tuple[int, int]:
    return eng.stats.prefix_cache_queries, eng.stats.prefix_cache_hits
