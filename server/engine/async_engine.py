"""The engine loop in a background thread, with results pushed to each request's asyncio queue.

The HTTP layer (an asyncio event loop) never runs a step itself: it adds requests (thread-safe on the
engine), then awaits its request's queue. The engine thread steps while there is work and sleeps on an
event when idle, so an idle server burns no CPU. After each step it hands every RequestOutput to the
event loop that asked for it with one `call_soon_threadsafe` per loop and step, not one per token.

A step that raises fails the requests then in flight (each gets an `EngineStepError`, which the server
turns into a 500 for that request alone), aborts them inside the engine so their KV blocks are freed,
and the loop carries on serving new requests.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from iterserve.server.engine.outputs import RequestOutput
from iterserve.server.engine.sampling_params import SamplingParams

logger = logging.getLogger("iterserve.engine")


class EngineStepError(RuntimeError):
    """The engine failed while this request was in flight; the request is aborted."""


class EngineStoppedError(RuntimeError):
    """The engine loop is not running (not started, or shut down)."""


@dataclass
class StepInfo:
    """What one step did, for metrics observers (called on the engine thread)."""

    outputs: list[RequestOutput]
    num_prompt_tokens: int  # prompt tokens computed this step (recomputation included)
    num_generation_tokens: int
    num_preemptions: int  # preemptions during this step
    duration: float  # seconds the step took
    end_time: float  # time.monotonic() at the end of the step


class AsyncEngine:
    def __init__(self, engine, *, idle_timeout: float = 1.0):
        self.engine = engine
        # request id -> (event loop, queue) of the coroutine awaiting its outputs
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._streams_lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._idle_timeout = idle_timeout  # an idle loop still wakes this often, to notice a stop
        self._thread: threading.Thread | None = None
        self.step_observers: list[Callable[[StepInfo], None]] = []
        self.num_step_failures = 0

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="iterserve-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self._fail_all(EngineStoppedError("the engine was shut down"))

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    # -- requests (event loop side) --------------------------------------------------------------

    async def generate(self, prompt: str | None, sampling_params: SamplingParams, *,
                       prompt_token_ids: list[int] | None = None, request_id: str,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Queue a request and yield its outputs as steps produce them; the last one has finished=True.

        Raises InvalidRequestError (from the engine's validation) at the first iteration. Callers that
        must know a request was accepted before answering (a streaming response) use `open_stream`
        and then `stream_outputs`.
        """
        queue = self.open_stream(request_id, prompt, sampling_params,
                                 prompt_token_ids=prompt_token_ids, priority=priority)
        async for out in self.stream_outputs(request_id, queue):
            yield out

    async def stream_outputs(self, request_id: str, queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        """Yield one opened request's outputs. If the consumer stops early (its client went away: the
        task is cancelled or the iterator closed), the request is aborted and its KV blocks are freed
        at the next step."""
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

    def open_stream(self, request_id: str, prompt, sampling_params, *, prompt_token_ids=None,
                    priority: int = 0) -> asyncio.Queue:
        """Add a request now (raising InvalidRequestError at once) and return the queue its outputs
        arrive on."""
        if not self.is_running:
            raise EngineStoppedError("the engine loop is not running")
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        with self._streams_lock:
            # registered before the engine can see the request, so no output can be missed
            self._streams[request_id] = (loop, queue)
        try:
            self.engine.add_request(prompt, sampling_params, prompt_token_ids=prompt_token_ids,
                                    request_id=request_id, priority=priority)
        except BaseException:
            with self._streams_lock:
                self._streams.pop(request_id, None)
            raise
        self._wake.set()
        return queue

    def abort(self, request_id: str) -> None:
        """Stop a request; nothing more is delivered for it."""
        with self._streams_lock:
            known = self._streams.pop(request_id, None) is not None
        if known:
            self.engine.abort_request(request_id)
            self._wake.set()

    def abort_all(self, reason: str) -> int:
        """Fail every request in flight with EngineStoppedError(reason) and abort it in the engine
        (the end of a drain that ran out of time). Returns how many there were."""
        failed = self._fail_all(EngineStoppedError(reason))
        for request_id in failed:
            self.engine.abort_request(request_id)
        self._wake.set()
        return len(failed)

    def update_knobs(self, **changes: int):
        """Validate and apply a knob change as a whole (the engine applies it at the next step)."""
        return self.engine.update_knobs(**changes)

    @property
    def num_in_flight(self) -> int:
        """Requests added through this wrapper whose final output has not been delivered yet."""
        return len(self._streams)

    def snapshot(self) -> dict:
        """Scheduler and cache state for metrics and admission (read from any thread; each number is
        a single read, so a step running meanwhile can make them off by one step, never torn)."""
        eng = self.engine
        sched = eng.scheduler
        return {
            "num_running": len(sched.running),
            "num_waiting": sched.num_waiting_requests(),
            "kv_cache_usage": eng.block_manager.usage,
            "kv_waste": eng.stats.kv_waste,
            "num_preemptions": eng.stats.num_preemptions,
            "knobs": eng.knobs.value,
            "num_knob_changes": eng.knobs.num_changes,
            "num_steps": eng.stats.num_steps,
            "num_step_failures": self.num_step_failures,
        }

    # -- the loop (engine thread) ----------------------------------------------------------------

    def _loop(self) -> None:
        engine = self.engine
        while not self._stopping:
            # clear before checking: a request added after the check sets the event again
            self._wake.clear()
            if not engine.has_unfinished_requests():
                self._wake.wait(self._idle_timeout)
                continue
            stats = engine.stats
            before = (stats.num_prompt_tokens_computed, stats.num_generated_tokens, stats.num_preemptions)
            start = time.monotonic()
            try:
                outputs = engine.step()
            except Exception as exc:  # noqa: BLE001 - one bad step must not take the server down
                self._on_step_failure(exc)
                continue
            end = time.monotonic()
            self._deliver(outputs)
            if self.step_observers:
                info = StepInfo(outputs, stats.num_prompt_tokens_computed - before[0],
                                stats.num_generated_tokens - before[1], stats.num_preemptions - before[2],
                                end - start, end)
                for observe in self.step_observers:
                    try:
                        observe(info)
                    except Exception:  # noqa: BLE001 - a metrics bug must not stop serving
                        logger.exception("step observer failed")

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        with self._streams_lock:
            for out in outputs:
                target = self._streams.get(out.request_id)
                if target is None:
                    continue  # aborted by its consumer; the engine's abort output goes nowhere
                if out.finished:
                    del self._streams[out.request_id]
                by_loop.setdefault(target[0], []).append((target[1], out))
        for loop, items in by_loop.items():
            _call_soon(loop, _put_all, items)

    def _on_step_failure(self, exc: Exception) -> None:
        self.num_step_failures += 1
        logger.exception("engine step failed; failing the requests in flight", exc_info=exc)
        failed = self._fail_all(EngineStepError(f"the engine failed while running this request: {exc}"))
        for request_id in failed:
            self.engine.abort_request(request_id)  # frees their blocks at the next step
        # a step that fails again at once (say, a broken device) must not spin the CPU
        time.sleep(0.05)

    def _fail_all(self, error: BaseException) -> list[str]:
        with self._streams_lock:
            streams, self._streams = self._streams, {}
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for loop, queue in streams.values():
            by_loop.setdefault(loop, []).append((queue, error))
        for loop, items in by_loop.items():
            _call_soon(loop, _put_all, items)
        return list(streams)


def _put_all(items) -> None:
    for queue, item in items:
        queue.put_nowait(item)


def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass  # that event loop is closed: nobody is waiting any more
