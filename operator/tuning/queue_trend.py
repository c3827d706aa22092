"""The fleet's waiting queue over time, for the scaler's growth rule: readings are (time, requests waiting),
each the average of the tuner's window that ended then. Growth is judged on readings of back-to-back
windows: with ticks shorter than the window, windows that overlap share their requests, so a burst of
arrivals would be read twice and pass for growth."""

from __future__ import annotations

QueueReading = tuple[float, float]


def recent(readings: tuple[QueueReading, ...], now: float, queued: float, window_s: float,
           windows: int) -> tuple[QueueReading, ...]:
    """The readings of the last `windows` + 1 windows (at most 64), this one (`now`, `queued`) added."""
    keep = (windows + 1) * window_s
    return (*[r for r in readings if r[0] >= now - keep][-63:], (now, queued))


def back_to_back(readings: tuple[QueueReading, ...], start: float, window_s: float,
                 windows: int) -> tuple[QueueReading, ...]:
    """Up to `windows` readings ending with the last one (whose window began at `start`), each of the
    window that ended where the next began, within a tenth of a window (ticks jitter); oldest first."""
    chain, edge = [readings[-1]], start
    for _ in range(windows - 1):
        before = [r for r in readings[:-1] if r[0] <= edge + 0.1 * window_s]
        if not before:
            break
        chain.append(before[-1])
        edge = before[-1][0] - window_s
    return tuple(reversed(chain))
