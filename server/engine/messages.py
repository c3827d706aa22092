"""The messages between the server (frontend) and the engine core, typed, as msgpack over ZeroMQ.

frontend -> core: AddRequest, AddChecked, Abort, UpdateKnobs, ResetPrefixCache, Shutdown.
core -> frontend: Ready (or StartupFailed) once, then a StepReport per step (and after every knob
change or prefix cache reset, so an idle engine's state is current), AddReply per AddChecked, KnobsReply
per UpdateKnobs, PrefixCacheReset per ResetPrefixCache, StepFailed when a step raised. Every
request-level field is keyed by request id; nothing depends on positions.
"""

from __future__ import annotations

import msgspec

from iterserve.server.engine.outputs import CoreOutput
from iterserve.server.engine.sampling_params import SamplingParams
from iterserve.server.errors import InvalidRequestError


class AddRequest(msgspec.Struct, tag=True, array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: int
    arrival_time: float  # time.monotonic() in the frontend (the clock is system-wide)


class SchemaCheck(msgspec.Struct, array_like=True):
    param: str  # the request's field the schema came from, which an error names
    schema: str  # JSON text


class AddChecked(msgspec.Struct, tag=True, array_like=True):
    """Requests (one HTTP request's choices) that carry JSON schemas: the core checks every schema (the
    grammar engine is the core's alone) and adds all the requests, or none if one schema fails; it answers
    with an AddReply before it runs any step with them."""

    call_id: int
    checks: list[SchemaCheck]
    requests: list[AddRequest]


class Abort(msgspec.Struct, tag=True, array_like=True):
    request_ids: list[str]


class UpdateKnobs(msgspec.Struct, tag=True, array_like=True):
    call_id: int
    changes: dict[str, int]


class ResetPrefixCache(msgspec.Struct, tag=True, array_like=True):
    call_id: int


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


class Snapshot(msgspec.Struct, array_like=True):
    """The core's state after a step: for metrics gauges and admission control."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # share of the blocks in use by requests
    kv_cache_cached_free: float  # share of the blocks free but holding a cached prefix
    kv_waste: float
    num_preemptions: int
    knobs: dict[str, int]
    num_knob_changes: int
    num_steps: int
    num_generated_tokens: int


class Ready(msgspec.Struct, tag=True, array_like=True):
    """The engine core is built: the facts the frontend validates requests against."""

    max_model_len: int
    vocab_size: int
    num_blocks: int
    block_size: int
    kv_cache_report: str
    pid: int
    snapshot: Snapshot  # the core's state before its first step (the knobs in force, above all)
    cpu_kernels: dict[str, bool] = {}  # C++ CPU kernel -> serving (False: the slower torch path)


class StartupFailed(msgspec.Struct, tag=True, array_like=True):
    """Building the engine failed on a user error; `param` names the flag when one is to blame."""

    kind: str  # "invalid" (a bad flag), "not_found", "value"
    param: str | None
    message: str


class StepStats(msgspec.Struct, array_like=True):
    num_prompt_tokens: int  # prompt tokens computed this step (recomputation included)
    num_generation_tokens: int
    num_preemptions: int  # preemptions during this step
    duration: float  # seconds the step took
    end_time: float  # time.monotonic() at the end of the step
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache at first admissions this step
    prefix_cache_hits: int  # of those, the tokens found cached


class StepReport(msgspec.Struct, tag=True, array_like=True):
    outputs: list[CoreOutput]
    stats: StepStats | None  # None for a report that ran no step (after a knob change)
    snapshot: Snapshot


class KnobsReply(msgspec.Struct, tag=True, array_like=True):
    call_id: int
    knobs: dict[str, int] | None  # the knobs in force after the change; None if it was refused
    error_param: str | None = None
    error_message: str | None = None


class AddReply(msgspec.Struct, tag=True, array_like=True):
    call_id: int
    error_param: str | None = None  # None: every request was added; else the first failing check's param
    error_message: str | None = None


class PrefixCacheReset(msgspec.Struct, tag=True, array_like=True):
    call_id: int
    num_blocks: int  # blocks that were findable in the cache


class StepFailed(msgspec.Struct, tag=True, array_like=True):
    """A step raised; the core aborted every request it held (their ids) and carries on."""

    message: str
    request_ids: list[str]
    snapshot: Snapshot


ToCore = AddRequest | AddChecked | Abort | UpdateKnobs | ResetPrefixCache | Shutdown
FromCore = Ready | StartupFailed | StepReport | AddReply | KnobsReply | PrefixCacheReset | StepFailed


def startup_failure(exc: Exception) -> StartupFailed:
    """What the core sends when building the engine raised a user's error (the core's side)."""
    if isinstance(exc, InvalidRequestError):
        return StartupFailed("invalid", exc.param, exc.message)
    return StartupFailed("not_found" if isinstance(exc, FileNotFoundError) else "value", None, str(exc))


def raise_startup_failure(failure: StartupFailed):
    """The exception building the engine in-process would have raised (the frontend's side)."""
    if failure.kind == "invalid":
        raise InvalidRequestError(failure.param or "config", failure.message)
    raise (FileNotFoundError if failure.kind == "not_found" else ValueError)(failure.message)
