"""Connection-level guards against slow clients: uvicorn's h11 protocol with two timers it lacks.

uvicorn closes a kept-alive connection that stays idle (`timeout_keep_alive`) and refuses a head over 16
KiB, but waits forever for a head that never ends and for a client that never reads. Here:

- a request head must be complete within `header_timeout` s of the connection opening, or of the first
  byte of a later request on a kept-alive connection, else the connection is closed (slowloris);
- a response whose client reads none of it for `stall_timeout` s while the socket's buffers are full
  (uvicorn has paused writing) is cut off. The app then sees a disconnect, as if the client had gone:
  its requests are aborted and their KV blocks freed at the next engine step.

The body's own deadline is `BodyLimit`'s, which can still answer (408).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger("iterserve.server")


def guarded_h11_protocol(header_timeout: float, stall_timeout: float,
                         on_cutoff: Callable[[str], None] | None = None) -> type[H11Protocol]:
    """An H11Protocol class with these timeouts, for uvicorn.Config(http=...). `on_cutoff` is called
    with "header_timeout" or "stall_timeout" for each connection cut."""

    class GuardedH11Protocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None
        _stall_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm_head_timer()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is h11.IDLE:  # part of a head so far
                self._arm_head_timer()
            else:
                _cancel(self._head_timer)
                self._head_timer = None

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._stall_timer is None:
                self._stall_timer = self.loop.call_later(stall_timeout, self._stalled)

        def resume_writing(self) -> None:
            super().resume_writing()
            _cancel(self._stall_timer)
            self._stall_timer = None

        def connection_lost(self, exc) -> None:
            _cancel(self._head_timer)
            self._head_timer = None
            _cancel(self._stall_timer)
            self._stall_timer = None
            super().connection_lost(exc)

        def _arm_head_timer(self) -> None:
            if self._head_timer is None and not self.transport.is_closing():
                self._head_timer = self.loop.call_later(header_timeout, self._head_timed_out)

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self._cut("header_timeout", f"no complete request head within {header_timeout:g} s")
                self.transport.close()

        def _stalled(self) -> None:
            self._stall_timer = None
            if not self.transport.is_closing():
                self._cut("stall_timeout", f"the client read nothing for {stall_timeout:g} s")
            # abort, not close: close would wait for the buffered bytes to reach a client that does not read
            self.transport.abort()

        def _cut(self, reason: str, why: str) -> None:
            client = "{}:{}".format(*self.client) if self.client else "a client"
            logger.info("closed the connection of %s: %s", client, why)
            if on_cutoff is not None:
                on_cutoff(reason)

    return GuardedH11Protocol


def _cancel(timer: asyncio.TimerHandle | None) -> None:
    if timer is not None:
        timer.cancel()
