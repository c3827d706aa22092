"""Blocking work for kopf's timer and daemon that a stop does not wait for.

kopf removes its finalizer from a deleted LLMService only once the object's timer and daemons have
exited. It cannot cancel a thread, and an exit that is not immediate is checked again only after the
daemon's cancellation back-off, or for a timer after kopf's 60 s polling period: a resync pass or a
tuner tick hung on a pod that accepts connections and never answers would hold `kubectl delete` that
long. So the blocking call runs in a thread of its own and the handler waits for it or for the stop,
whichever comes first. An abandoned call runs on to its own timeouts; what it writes then finds the
object gone (status writes check for it, and children created meanwhile carry an owner reference to the
deleted object, which garbage collection follows).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("iterserve.operator")
STOPPED = object()  # what `unless_stopped` returns when the stop came first


async def unless_stopped(stopped, func: Callable[..., Any], *args, **kwargs) -> Any:
    """`func(*args, **kwargs)` in a thread; its result, or STOPPED as soon as `stopped` (kopf's
    DaemonStopped) is set, leaving the thread to finish alone."""
    work = asyncio.ensure_future(asyncio.to_thread(func, *args, **kwargs))
    stop = asyncio.ensure_future(stopped.wait())
    try:
        await asyncio.wait({work, stop}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
    if work.done():
        return work.result()
    work.add_done_callback(_log_late_failure)
    return STOPPED


def detach(func: Callable[..., Any], *args) -> None:
    """Run `func(*args)` in a thread and do not wait: clean-up a daemon's exit must not be held up by."""
    task = asyncio.ensure_future(asyncio.to_thread(func, *args))
    _detached.add(task)  # a reference until it ends, or the task could be garbage-collected mid-way
    task.add_done_callback(_detached.discard)
    task.add_done_callback(_log_late_failure)


_detached: set[asyncio.Future] = set()


def _log_late_failure(task: asyncio.Future) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.warning("background work that was not waited for failed: %r", task.exception())
