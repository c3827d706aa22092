"""`EngineClient`: the server's handle on the engine core, which runs in its own process.

The HTTP side (an asyncio event loop) never runs a step. It validates a request (InputProcessor),
registers the asyncio queue its outputs go to, and sends it to the core; requests that carry a JSON
schema wait for the core's AddReply, since only the core's process has the grammar engine that checks it
(this process imports neither it nor torch). A receiver thread takes the core's step reports, detokenizes
them (OutputProcessor), aborts in the core what a stop string ended, and hands each output to the event
loop that asked for it, one `call_soon_threadsafe` per loop and step. Metrics observers see every step
there. `in_process=True` runs the same core loop in a thread of this process instead (tests that reach
into the engine; debugging), over the same messages (core_launch.py starts either).

A step that raises fails the requests then in flight (each gets an `EngineStepError`, which the server
turns into a 500 for that request alone); the core aborts them and carries on. A core process that dies
fails every request in flight with `EngineStoppedError` and leaves `is_running` false, so /health fails.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from iterserve.common.wire import Knobs
from iterserve.server.config import EngineConfig
from iterserve.server.engine.channels import QueueChannel, ZmqChannel
from iterserve.server.engine.core_launch import CoreLaunch
from iterserve.server.engine.input_processor import InputProcessor
from iterserve.server.engine.knobs import validate_change
from iterserve.server.engine.messages import (
    Abort,
    AddChecked,
    AddReply,
    AddRequest,
    KnobsReply,
    PrefixCacheReset,
    ResetPrefixCache,
    SchemaCheck,
    Shutdown,
    StepFailed,
    StepReport,
    UpdateKnobs,
)
from iterserve.server.engine.output_processor import OutputProcessor
from iterserve.server.engine.outputs import RequestOutput
from iterserve.server.engine.sampling_params import SamplingParams
from iterserve.server.errors import InvalidRequestError

if TYPE_CHECKING:  # torch and the grammar engine are the core's, not imported here at run time
    from iterserve.server.engine.core import EngineCore
    from iterserve.server.engine.request import Request
    from iterserve.server.model.tokenizer import Tokenizer

logger = logging.getLogger("iterserve.engine")


class EngineStepError(RuntimeError):
    """The engine failed while this request was in flight; the request is aborted."""


class EngineStoppedError(RuntimeError):
    """The engine is not running (not started, shut down, or its process died)."""


@dataclass
class StepInfo:
    """What one step did, for metrics observers (called on the receiver thread)."""

    outputs: list[RequestOutput]
    num_prompt_tokens: int  # prompt tokens computed this step (recomputation included)
    num_generation_tokens: int
    num_preemptions: int  # preemptions during this step
    duration: float  # seconds the step took
    end_time: float  # time.monotonic() at the end of the step
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache at first admissions
    prefix_cache_hits: int  # of those, the tokens found cached


class EngineClient:
    def __init__(self, config: EngineConfig, *, in_process: bool = False, log_level: str = "warning"):
        self.config = config
        self.in_process = in_process
        self.core: EngineCore | None = None  # the EngineCore itself, in-process only
        self.tokenizer: Tokenizer | None = None  # None: a dummy model without tokenizer.json
        self._channel: QueueChannel | ZmqChannel  # set by start()
        self.step_observers: list[Callable[[StepInfo], None]] = []
        self.num_step_failures = 0
        self.cpu_kernels: dict[str, bool] = {}  # from the core's Ready: C++ CPU kernel -> serving
        # request id -> (event loop, queue) of the coroutine awaiting its outputs
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()  # _streams, _unprefilled and the output processor
        # request id -> prompt tokens, until the request's first output: the prefill still ahead of the
        # pod's new prompts, for a load-aware router (`num_prompt_tokens_pending`)
        self._unprefilled: dict[str, int] = {}
        self._send_lock = threading.Lock()  # a ZeroMQ socket is not thread-safe
        # call id -> (event loop, future) of a coroutine awaiting the core's reply (checked adds, knobs, cache reset)
        self._calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._call_ids = itertools.count()
        self._alive = False
        self._stopping = False
        self._launch = CoreLaunch(config, log_level)

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine core and wait until it is ready. A bad model or flag raises what building
        the engine raises (InvalidRequestError, FileNotFoundError, ValueError), naming it."""
        ready, tokenizer = self._launch.start(self.in_process)
        assert self._launch.channel is not None
        self.core, self._channel = self._launch.core, self._launch.channel
        self.tokenizer = tokenizer
        self.max_model_len, self.vocab_size = ready.max_model_len, ready.vocab_size
        self.kv_cache_report = ready.kv_cache_report
        self.cpu_kernels = dict(ready.cpu_kernels)
        self._snapshot = ready.snapshot
        self.input_processor = InputProcessor(tokenizer, ready.max_model_len, ready.vocab_size)
        self.output_processor = OutputProcessor(tokenizer)
        self._alive = True
        self._receiver = threading.Thread(target=self._receive_loop, name="iterserve-engine-client", daemon=True)
        self._receiver.start()

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stopping = True
        if self._alive:
            self._send(Shutdown())
        if getattr(self, "_receiver", None) is not None:
            self._receiver.join(timeout)
        self._launch.stop(timeout)
        self._alive = False
        self._fail_all(EngineStoppedError("the engine was shut down"))

    @property
    def is_running(self) -> bool:
        return self._alive and not self._stopping

    # -- requests (event loop side) --------------------------------------------------------------

    def make_request(self, prompt: str | None = None, sampling_params: SamplingParams | None = None, **kw):
        """Validate a request without queueing it (raises InvalidRequestError naming the field)."""
        return self.input_processor.make_request(prompt, sampling_params, **kw)

    async def open_streams(self, choices: list[tuple[str, list[int], SamplingParams]], *, priority: int = 0,
                           schema_checks: list[tuple[str, str]] | None = None) -> list[asyncio.Queue]:
        """Add requests together (one HTTP request's choices: request id, prompt token ids, parameters) and
        return the queues their outputs arrive on; one that is refused (InvalidRequestError) leaves none
        added. `schema_checks`, (param, JSON schema text) for every schema they carry: the core checks them
        before it adds any, and a schema it cannot take raises InvalidRequestError naming its param."""
        adds: list[AddRequest] = []
        queues: list[asyncio.Queue] = []
        try:
            if not self.is_running:
                raise EngineStoppedError("the engine is not running")
            for request_id, prompt_token_ids, params in choices:
                req = self.make_request(None, params, prompt_token_ids=prompt_token_ids, request_id=request_id,
                                        priority=priority)
                queues.append(self._register(req))
                adds.append(AddRequest(request_id, req.prompt_token_ids, req.sampling_params, req.priority,
                                       req.arrival_time))
            if not schema_checks:
                for add in adds:
                    self._send(add)
                return queues
            checks = [SchemaCheck(param, schema) for param, schema in schema_checks]
            future = self._start_call(lambda call_id: AddChecked(call_id, checks, adds))
        except BaseException:
            self._forget([a.request_id for a in adds])  # registered here, never sent
            raise
        ids = [a.request_id for a in adds]
        try:
            reply: AddReply = await asyncio.shield(future)
        except asyncio.CancelledError:
            # the caller went away while the core checked: settle with whatever the core then did
            future.add_done_callback(lambda done: self._settle(ids, done))
            raise
        except BaseException:  # the core stopped: their streams were failed; their state goes too
            self._forget(ids)
            raise
        if reply.error_param is not None:
            self._forget(ids)  # the core added none of them
            raise InvalidRequestError(reply.error_param, reply.error_message or "refused")
        return queues

    def _register(self, req: Request) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if req.request_id in self._streams or self.output_processor.has_request(req.request_id):
                raise InvalidRequestError("request_id", f"{req.request_id!r} is already in use")
            # registered before the core can see the request, so no output can be missed
            self._streams[req.request_id] = (asyncio.get_running_loop(), queue)
            self._unprefilled[req.request_id] = len(req.prompt_token_ids)
            self.output_processor.add_request(req.request_id, req.prompt_token_ids, req.sampling_params,
                                              req.arrival_time)
        return queue

    def _forget(self, request_ids: list[str]) -> None:
        """Drop requests the core never added (nothing to abort there)."""
        with self._lock:
            for request_id in request_ids:
                self._streams.pop(request_id, None)
                self._unprefilled.pop(request_id, None)
                self.output_processor.remove_request(request_id)

    def _settle(self, request_ids: list[str], reply: asyncio.Future) -> None:
        """The AddReply of a caller that stopped waiting: abort what the core added, forget what it did not."""
        if reply.cancelled() or reply.exception() is not None or reply.result().error_param is not None:
            self._forget(request_ids)
        else:
            for request_id in request_ids:
                self.abort(request_id)

    async def stream_outputs(self, request_id: str, queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        """Yield one opened request's outputs. If the consumer stops early (its client went away: the
        task is cancelled or the iterator closed), the request is aborted and its KV blocks are freed
        at the core's next step."""
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine already forgot it
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request; nothing more is delivered for it."""
        with self._lock:
            known = self._streams.pop(request_id, None) is not None
            self._unprefilled.pop(request_id, None)
        if known and self._alive:
            self._send(Abort([request_id]))

    def abort_all(self, reason: str) -> int:
        """Fail every request in flight with EngineStoppedError(reason) and abort it in the core (the
        end of a drain that ran out of time). Returns how many there were."""
        failed = self._fail_all(EngineStoppedError(reason))
        if failed and self._alive:
            self._send(Abort(failed))
        return len(failed)

    async def update_knobs(self, **changes: int) -> Knobs:
        """Validate a knob change as a whole, and apply it in the core (from its next step on)."""
        validate_change(self.knobs, changes)  # refused here, at once, without a round trip
        reply: KnobsReply = await self._call(lambda call_id: UpdateKnobs(call_id, dict(changes)))
        if reply.knobs is None:
            raise InvalidRequestError(reply.error_param or "knobs", reply.error_message or "refused")
        return Knobs(**reply.knobs)

    async def reset_prefix_cache(self) -> int:
        """Forget every cached prefix in the core (between two of its steps); returns how many blocks
        were findable."""
        reply: PrefixCacheReset = await self._call(ResetPrefixCache)
        return reply.num_blocks

    async def _call(self, make_message):
        """Send the message `make_message(call_id)` and await the core's reply to that call id."""
        return await self._start_call(make_message)

    def _start_call(self, make_message) -> asyncio.Future:
        if not self.is_running:
            raise EngineStoppedError("the engine is not running")
        loop = asyncio.get_running_loop()
        call_id, future = next(self._call_ids), loop.create_future()
        self._calls[call_id] = (loop, future)
        self._send(make_message(call_id))
        return future

    # -- state (any thread) ----------------------------------------------------------------------

    @property
    def num_in_flight(self) -> int:
        """Requests added through this client whose final output has not been delivered yet."""
        return len(self._streams)

    @property
    def num_prompt_tokens_pending(self) -> int:
        """Prompt tokens of the requests in flight that have produced no output yet: the prefill work
        queued ahead of a prompt that arrives now (prefix-cache hits included, which cost little)."""
        with self._lock:
            return sum(self._unprefilled.values())

    @property
    def knobs(self) -> Knobs:
        return Knobs(**self._snapshot.knobs)

    def snapshot(self) -> dict:
        """The core's state after its latest step, for metrics and admission. `num_waiting` counts the
        requests accepted here and not yet running in the core, so a request counts from the moment it
        is accepted, not from the core's next step."""
        s = self._snapshot
        return {"num_running": s.num_running, "num_waiting": max(0, self.num_in_flight - s.num_running),
                "kv_cache_usage": s.kv_cache_usage,
                "kv_cache_cached_free": s.kv_cache_cached_free, "kv_waste": s.kv_waste,
                "num_preemptions": s.num_preemptions,
                "knobs": self.knobs, "num_knob_changes": s.num_knob_changes, "num_steps": s.num_steps,
                "num_generated_tokens": s.num_generated_tokens, "num_step_failures": self.num_step_failures}

    # -- the receiver thread ---------------------------------------------------------------------

    def _receive_loop(self) -> None:
        while not self._stopping:
            messages = self._channel.receive(0.5)
            for message in messages:
                try:
                    self._on_message(message)
                except Exception:  # noqa: BLE001 - a bad report must not stop the deliveries
                    logger.exception("handling an engine core message failed")
            if not messages and not self._launch.alive() and not self._stopping:
                code = self._launch.exit_status
                logger.error("the engine core stopped (exit status %s); failing every request in flight", code)
                self._alive = False
                self._fail_all(EngineStoppedError(f"the engine core stopped (exit status {code})"))
                for loop, future in self._calls.values():
                    _call_soon(loop, _set_exception, future, EngineStoppedError("the engine core stopped"))
                return

    def _on_message(self, message) -> None:
        if isinstance(message, StepReport):
            self._snapshot = message.snapshot
            with self._lock:
                outputs, stopped = self.output_processor.process(message.outputs)
            if stopped:
                self._send(Abort(stopped))  # ended by a stop string: the core frees them at its next step
            self._deliver(outputs)
            if message.stats is not None:
                self._observe(StepInfo(outputs, *msgspec.structs.astuple(message.stats)))
        elif isinstance(message, (AddReply, KnobsReply, PrefixCacheReset)):
            loop, future = self._calls.pop(message.call_id)
            _call_soon(loop, _set_result, future, message)
        elif isinstance(message, StepFailed):
            self.num_step_failures += 1
            self._snapshot = message.snapshot
            error = EngineStepError(message.message)
            with self._lock:
                streams = {rid: self._streams.pop(rid) for rid in message.request_ids if rid in self._streams}
                for rid in message.request_ids:
                    self._unprefilled.pop(rid, None)
            self._put(streams.values(), error)

    def _observe(self, info: StepInfo) -> None:
        for observe in self.step_observers:
            try:
                observe(info)
            except Exception:  # noqa: BLE001 - a metrics bug must not stop serving
                logger.exception("step observer failed")

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        with self._lock:
            for out in outputs:
                self._unprefilled.pop(out.request_id, None)
                target = self._streams.get(out.request_id)
                if target is None:
                    continue  # aborted by its consumer; its last outputs go nowhere
                if out.finished:
                    del self._streams[out.request_id]
                by_loop.setdefault(target[0], []).append((target[1], out))
        for loop, items in by_loop.items():
            _call_soon(loop, _put_all, items)

    def _fail_all(self, error: BaseException) -> list[str]:
        with self._lock:
            streams, self._streams = self._streams, {}
            self._unprefilled.clear()
        self._put(streams.values(), error)
        return list(streams)

    def _put(self, streams, item) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for loop, queue in streams:
            by_loop.setdefault(loop, []).append((queue, item))
        for loop, items in by_loop.items():
            _call_soon(loop, _put_all, items)

    def _send(self, message) -> None:
        with self._send_lock:
            self._channel.send(message)


def _put_all(items) -> None:
    for queue, item in items:
        queue.put_nowait(item)


def _set_result(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)


def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass  # that event loop is closed: nobody is waiting any more
