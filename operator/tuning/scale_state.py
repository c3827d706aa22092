"""The replica decision's data: the scaler's policy (`ScalePolicy`), what one tick sees (`Fleet`), what it
carries from one tick to the next (`ScaleState`, with the `WindowLoad`s it looks back on) and what it
returns (`ScaleDecision`). scale.py decides."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from iterserve.operator.tuning.decision import Condition
from iterserve.operator.tuning.observation import Observation
from iterserve.operator.tuning.reading import Reading

SCALE_OUT, SCALE_IN, STAY = "scale_out", "scale_in", "stay"
EXHAUSTED = ("BoundsReached", "NoBetterSetting")  # the tuner's verdicts that say no knob setting is left


@dataclass(frozen=True)
class ScalePolicy:
    min_replicas: int
    max_replicas: int
    scale_up_window_s: float = 0.0  # pressure must last this long before pods are added
    scale_down_window_s: float = 300.0  # headroom must last this long before a pod is removed
    settle_s: float = 60.0  # after a change, a window measured entirely after it (the tuner's window)
    window_s: float = 60.0  # the tuner's window: a queue reading of under half of it is not weighed for growth
    headroom_line: float = 0.8  # worst p99 / SLO under which the fleet has headroom (the tuner's line)
    margin: float = 0.2  # a scale-in must leave each pod under (1 - margin) of its capacity and batch cap
    queue_windows: int = 2  # rising readings of the queue, of back-to-back windows, that count as growing...
    queue_growth: float = 0.1  # ... when it grows by at least this share of the completion rate
    backlog_windows: float = 2.0  # a breach whose queue would take longer than this many windows to drain stands
    pod_start_s: float = 600.0  # how long pods added by a scale-out are waited for before adding more
    max_factor: float = 2.0  # one scale-out at most multiplies the fleet by this (or adds max_step pods)
    max_step: int = 4
    max_in_share: float = 0.5  # one scale-in removes at most this share of the fleet (one pod at least)
    full_batch: float = 0.75  # share of max_num_seqs running per pod that counts as full (the tuner's line)


@dataclass(frozen=True)
class Fleet:
    """What one tick saw: the replicas wanted and ready, the window and its reading (None when the window
    had too few samples to judge), the tuner's verdict and action, and what may stop the scaler."""

    replicas: int  # desired now (the Deployment's)
    ready: int
    obs: Observation | None
    reading: Reading | None
    verdict: Condition  # the tuner's Tuned condition after its tick
    tuner_action: str  # the tuner's action this tick
    knobs_fixed: bool = False  # tuning mode observe: the tuner recommends but moves nothing
    batch_cap: int = 0  # max_num_seqs in force on each pod
    knobs: object = None  # the knobs in force (any comparable value): a capacity learned under others is stale
    conflicts: tuple[str, ...] = ()  # HorizontalPodAutoscalers that target the same service


class WindowLoad(NamedTuple):
    """What one window asked of the fleet, for the scale-in's look back."""

    read_at: float  # it is looked back on for the scale-down window from here
    start: float  # when it began: those that began inside the one that first showed headroom are not counted
    rate: float  # requests/s finished
    in_flight: float  # requests running or waiting


@dataclass(frozen=True)
class ScaleState:
    last_scale_time: float | None = None
    last_direction: str | None = None
    pressure_since: float | None = None  # the scale-out condition has held since
    headroom_since: float | None = None  # the fleet has had headroom since
    queue: tuple[tuple[float, float], ...] = ()  # recent (time, requests waiting in the fleet), oldest first
    starting: bool = False  # pods a scale-out added have not all been ready yet
    whole_since: float | None = None  # when they all were
    capacity: float | None = None  # requests per second one pod finishes at the edge of the SLO
    capacity_knobs: object = None  # the knobs it was learned under
    goal: int | None = None  # what the last scale-out's evidence asked for, beyond its step limit
    proven: float | None = None  # the highest requests/s per pod seen in a window that met the SLO
    # the whole windows read within the scale-down window, oldest first: the load a scale-in must fit is the
    # highest of those since the headroom began
    loads: tuple[WindowLoad, ...] = ()
    start_s: float | None = None  # how long the last scale-out's pods took to be ready (measured)
    last_queue: tuple[float, float] | None = None  # the previous (time, requests waiting), settling or not
    queue_before: tuple[float, float] | None = None  # ... and the one before it


@dataclass(frozen=True)
class ScaleDecision:
    action: str  # SCALE_OUT, SCALE_IN or STAY
    replicas: int  # desired after this decision
    reason: str
    condition: Condition  # the `Autoscaling` condition
    state: ScaleState
