"""The engine core's loop, fed by messages: in its own process (`python -m iterserve.server.engine.core_proc`,
started by the server's EngineClient) or in a thread of the caller's.

    loop:  take every message waiting (requests, aborts, knob changes)  ->  step if there is work  ->  report

An idle core blocks on its channel, so it burns no CPU. The server's HTTP handling, tokenization and
detokenization run in the other process, so they never take the interpreter from a step (vLLM v1 splits
its engine the same way). A step that raises fails the requests then in flight (the core aborts them and
reports their ids) and the loop carries on; the process exits when told to or when its parent is gone.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import msgspec

from iterserve.server.engine.core import EngineCore
from iterserve.server.engine.messages import (
    Abort,
    AddChecked,
    AddReply,
    AddRequest,
    KnobsReply,
    PrefixCacheReset,
    Ready,
    ResetPrefixCache,
    Shutdown,
    Snapshot,
    StepFailed,
    StepReport,
    StepStats,
    ToCore,
    UpdateKnobs,
    startup_failure,
)
from iterserve.server.engine.request import Request
from iterserve.server.errors import InvalidRequestError

logger = logging.getLogger("iterserve.engine")

IDLE_POLL_S = 1.0  # an idle core still wakes this often, to notice that its parent has gone


class EngineCoreLoop:
    def __init__(self, core: EngineCore, channel, parent_pid: int | None = None):
        self.core = core
        self.channel = channel
        self.parent_pid = parent_pid  # exit when this process is no longer our parent
        self.num_step_failures = 0
        if core.grammar is not None:
            core.grammar.warm_up()  # a served model gets its grammar compiler ready before the first request

    def run(self) -> None:
        core = self.core
        while True:
            idle = not core.has_unfinished_requests()
            for message in self.channel.receive(IDLE_POLL_S if idle else 0):
                if isinstance(message, Shutdown):
                    return
                self._handle(message)
            if self.parent_pid is not None and os.getppid() != self.parent_pid:
                logger.warning("the server process is gone; the engine core exits")
                return
            if core.has_unfinished_requests():
                self._step()

    def _handle(self, message) -> None:
        core = self.core
        if isinstance(message, AddRequest):
            self._add(message)
        elif isinstance(message, AddChecked):
            try:
                for check in message.checks:  # well under a millisecond each, and cached by the schema
                    core.check_schema(check.schema, check.param)
            except InvalidRequestError as e:
                self.channel.send(AddReply(message.call_id, e.param, e.message))
                return
            for add in message.requests:
                self._add(add)
            self.channel.send(AddReply(message.call_id))  # before any step that runs them
        elif isinstance(message, Abort):
            for request_id in message.request_ids:
                core.abort_request(request_id)
        elif isinstance(message, UpdateKnobs):
            try:
                knobs = core.update_knobs(**message.changes)
            except InvalidRequestError as e:
                self.channel.send(KnobsReply(message.call_id, None, e.param, e.message))
                return
            # the snapshot first: the client handles messages in order, so the caller that awaits the reply
            # and then reads the knobs (GET /admin/scheduler, /metrics) finds them already in force
            self.channel.send(StepReport([], None, self.snapshot()))
            self.channel.send(KnobsReply(message.call_id, knobs.as_dict()))
        elif isinstance(message, ResetPrefixCache):
            num_blocks = core.reset_prefix_cache()  # between steps: this loop is the engine thread
            self.channel.send(StepReport([], None, self.snapshot()))
            self.channel.send(PrefixCacheReset(message.call_id, num_blocks))

    def _add(self, message: AddRequest) -> None:
        self.core.add_request(Request(request_id=message.request_id, prompt_token_ids=message.prompt_token_ids,
                                      sampling_params=message.sampling_params, priority=message.priority,
                                      arrival_time=message.arrival_time))

    def _step(self) -> None:
        core, stats = self.core, self.core.stats
        before = (stats.num_prompt_tokens_computed, stats.num_generated_tokens, stats.num_preemptions,
                  stats.prefix_cache_queries, stats.prefix_cache_hits)
        start = time.monotonic()
        try:
            outputs = core.step()
        except Exception as exc:  # noqa: BLE001 - one bad step must not take the engine down
            self._on_step_failure(exc)
            return
        end = time.monotonic()
        step = StepStats(stats.num_prompt_tokens_computed - before[0], stats.num_generated_tokens - before[1],
                         stats.num_preemptions - before[2], end - start, end,
                         stats.prefix_cache_queries - before[3], stats.prefix_cache_hits - before[4])
        self.channel.send(StepReport(outputs, step, self.snapshot()))

    def _on_step_failure(self, exc: Exception) -> None:
        self.num_step_failures += 1
        logger.exception("engine step failed; failing the requests in flight", exc_info=exc)
        ids = self.core.unfinished_request_ids()
        for request_id in ids:
            self.core.abort_request(request_id)  # frees their blocks at the next step
        self.channel.send(StepFailed(f"the engine failed while running this request: {exc}", ids, self.snapshot()))
        time.sleep(0.05)  # a step that fails again at once (say, a broken device) must not spin the CPU

    def snapshot(self) -> Snapshot:
        core = self.core
        sched, stats, bm = core.scheduler, core.stats, core.block_manager
        return Snapshot(num_running=len(sched.running), num_waiting=sched.num_waiting_requests(),
                        kv_cache_usage=bm.usage, kv_cache_cached_free=bm.num_cached_free_blocks / bm.num_blocks,
                        kv_waste=stats.kv_waste,
                        num_preemptions=stats.num_preemptions, knobs=core.knobs.value.as_dict(),
                        num_knob_changes=core.knobs.num_changes, num_steps=stats.num_steps,
                        num_generated_tokens=stats.num_generated_tokens)


def ready_message(built, snapshot: Snapshot) -> Ready:
    core = built.core
    return Ready(max_model_len=core.max_model_len, vocab_size=built.vocab_size,
                 num_blocks=core.block_manager.num_blocks, block_size=core.block_manager.block_size,
                 kv_cache_report=built.kv_cache_report, pid=os.getpid(), snapshot=snapshot,
                 cpu_kernels=built.cpu_kernels)


def main(argv: list[str] | None = None) -> int:
    from iterserve.server.config import EngineConfig
    from iterserve.server.engine.channels import ZmqChannel
    from iterserve.server.engine.engine_factory import build_engine_core

    ap = argparse.ArgumentParser(description="the engine core of `iterserve serve` (started by it)")
    ap.add_argument("--input", required=True, help="ZeroMQ address the server sends to")
    ap.add_argument("--output", required=True, help="ZeroMQ address the server receives on")
    ap.add_argument("--config", required=True, help="the EngineConfig as JSON")
    ap.add_argument("--log-level", default="info")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        stream=sys.stderr)
    parent = os.getppid()
    # linger: the last messages (a StartupFailed, the reports before a shutdown) still go out on close
    channel = ZmqChannel(args.output, args.input, ToCore, bind=False, linger_ms=2000)
    try:
        try:
            built = build_engine_core(msgspec.json.decode(args.config, type=EngineConfig))
        except (InvalidRequestError, FileNotFoundError, ValueError) as e:
            channel.send(startup_failure(e))
            return 2
        loop = EngineCoreLoop(built.core, channel, parent_pid=parent)
        channel.send(ready_message(built, loop.snapshot()))
        loop.run()
        return 0
    finally:
        channel.close()


if __name__ == "__main__":
    sys.exit(main())
