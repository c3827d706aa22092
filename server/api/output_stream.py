"""One job's outputs on their way to its HTTP response: every choice's engine stream, drained as the engine
produces it into one bounded buffer, read in arrival order by the response.

Only `EngineClient`'s interface is used (`stream_outputs`, whose early exit aborts a request), so this holds
whether the engine runs in this process or behind a client of another one.

The buffer is bounded whatever the reader does. A reader that keeps up gets every output as the engine
made it. One that falls behind (a busy event loop, a slow network) finds at most `MERGE_AFTER` outputs of a
choice waiting; later ones are merged into the last (their new tokens, text and logprobs joined, as vLLM
does), so the response sends fewer, larger chunks. A reader that leaves `max_buffered_tokens` tokens of a
choice untaken has stopped reading (its socket is full): every choice of the job is aborted, freeing its
KV blocks at the next step, and the reader gets `StalledReaderError` should it ever come back.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

from iterserve.server.engine.outputs import RequestOutput

MERGE_AFTER = 16  # outputs of one choice waiting before later ones are merged into the last


class StalledReaderError(RuntimeError):
    """The job's reader took none of its output for too long; its choices were aborted."""


class _Buffer:
    """Outputs waiting for the reader: (choice index, output or exception) in arrival order."""

    def __init__(self, max_tokens: int, on_overflow: Callable[[], None]):
        self.items: deque[list] = deque()  # [index, item]; lists, so that a merge edits one in place
        self._last: dict[int, list] = {}  # each choice's newest waiting output
        self._count: dict[int, int] = {}  # how many of its outputs wait
        self._tokens: dict[int, int] = {}  # and how many tokens they carry
        self._ready = asyncio.Event()
        self._max_tokens = max_tokens
        self._on_overflow = on_overflow
        self.error: BaseException | None = None

    def put(self, index: int, item) -> None:
        if self.error is not None:
            return
        if not isinstance(item, RequestOutput):
            self.items.append([index, item])
            self._ready.set()
            return
        tokens = self._tokens[index] = self._tokens.get(index, 0) + len(item.new_token_ids)
        if tokens > self._max_tokens:
            self.fail(StalledReaderError(f"the client read none of the last {tokens} tokens of a choice"))
            self._on_overflow()
            return
        last = self._last.get(index)
        if last is not None and self._count[index] >= MERGE_AFTER:
            last[1] = _merge(last[1], item)
            return
        entry = [index, item]
        self.items.append(entry)
        self._last[index] = entry
        self._count[index] = self._count.get(index, 0) + 1
        self._ready.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self._ready.set()

    async def get(self):
        while not self.items:
            if self.error is not None:
                raise self.error
            self._ready.clear()
            await self._ready.wait()
        index, item = self.items.popleft()
        if isinstance(item, RequestOutput):
            self._tokens[index] -= len(item.new_token_ids)
            self._count[index] -= 1
            if self._count[index] == 0:
                del self._last[index]
        return index, item


def _merge(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """b, carrying a's new tokens too (b is the later output of the same request)."""
    return replace(
        b,
        new_token_ids=a.new_token_ids + b.new_token_ids,
        new_text=a.new_text + b.new_text,
        new_logprobs=None if b.new_logprobs is None else (a.new_logprobs or []) + b.new_logprobs,
        new_top_logprobs=None if b.new_top_logprobs is None else (a.new_top_logprobs or []) + b.new_top_logprobs,
    )


async def merged_outputs(engine, choices, queues: list[asyncio.Queue], max_buffered_tokens: int,
                         on_stall: Callable[[], None] | None = None) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) for every choice (objects with `index` and `request_id`, each opened on
    `engine` with its queue), in the order they arrive. Closing this iterator, or cancelling its consumer,
    aborts every choice not yet finished; so does a reader that stops reading (`on_stall` is called)."""

    def overflow() -> None:
        for t in tasks:
            t.cancel()  # each pump's stream_outputs aborts its request on the way out
        if on_stall is not None:
            on_stall()

    buffer = _Buffer(max_buffered_tokens, overflow)

    async def pump(choice, queue: asyncio.Queue) -> None:
        try:
            async for out in engine.stream_outputs(choice.request_id, queue):
                buffer.put(choice.index, out)
        except Exception as e:  # noqa: BLE001 - handed to the reader, which raises it
            buffer.put(choice.index, e)

    tasks = [asyncio.create_task(pump(c, q)) for c, q in zip(choices, queues, strict=True)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await buffer.get()
            if isinstance(item, Exception):
                raise item
            if item.finished:
                remaining -= 1
            yield index, item
    finally:
        for t in tasks:
            t.cancel()
