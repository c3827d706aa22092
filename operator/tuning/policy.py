"""`TuningPolicy`: everything the tuner is told about one service, in one validated dataclass.

Built from plain values (the operator maps an LLMService's `slo` and `tuning` to it). Defaults and the
reasons behind them are in docs/tuning.md. A bad value raises `InvalidPolicyError` naming the field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

MODES = ("off", "observe", "auto")


class InvalidPolicyError(ValueError):
    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


@dataclass(frozen=True)
class KnobBounds:
    """Inclusive range the tuner keeps one knob in."""

    min: int
    max: int

    def clamp(self, value: int) -> int:
        return max(self.min, min(self.max, value))

    def __contains__(self, value: int) -> bool:
        return self.min <= value <= self.max


def _bounds(name: str, value) -> KnobBounds:
    if isinstance(value, KnobBounds):
        lo, hi = value.min, value.max
    elif isinstance(value, dict):
        unknown = set(value) - {"min", "max"}
        if unknown or not value:
            raise InvalidPolicyError(name, f"expected {{min, max}}, got {value!r}")
        lo, hi = value.get("min", 1), value.get("max", 2**20)
    elif isinstance(value, (tuple, list)) and len(value) == 2:
        lo, hi = value
    else:
        raise InvalidPolicyError(name, f"expected {{min, max}} or a (min, max) pair, got {value!r}")
    for part, v in (("min", lo), ("max", hi)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InvalidPolicyError(f"{name}.{part}", f"must be an integer >= 1, got {v!r}")
    if lo > hi:
        raise InvalidPolicyError(name, f"min {lo} is above max {hi}")
    return KnobBounds(lo, hi)


@dataclass(frozen=True)
class TuningPolicy:
    # the objective: p99 of time to first token and of inter-token latency, in milliseconds
    ttft_p99_ms: float
    itl_p99_ms: float
    mode: str = "auto"  # off: nothing; observe: measure and recommend; auto: also apply
    # bounds the tuner never leaves ({min, max} dicts or (min, max) pairs are accepted)
    max_num_seqs_bounds: KnobBounds = field(default_factory=lambda: KnobBounds(1, 64))
    prefill_chunk_size_bounds: KnobBounds = field(default_factory=lambda: KnobBounds(16, 512))
    interval_s: float = 30.0  # time between two ticks
    window_s: float = 60.0  # sliding window the observation covers (never reaching back past a change)
    min_samples: int = 20  # first tokens a window needs before it decides anything
    headroom: float = 0.2  # raise only while both p99s are below (1 - headroom) x SLO: the hysteresis band
    kv_pressure: float = 0.9  # KV usage at or above which max_num_seqs is not raised
    max_preemption_rate: float = 0.0  # preemptions per second tolerated before backing off
    max_error_rate: float = 0.0  # errors (failed steps, 5xx answers) per second tolerated before backing off
    min_waiting: float = 0.5  # mean requests waiting that, with a full batch, count as the batch cap binding
    full_batch: float = 0.75  # share of max_num_seqs (per pod) running on average that counts as a full batch
    cooldown_s: float | None = None  # least time between two changes; None: window_s
    seqs_step: int = 2  # additive increase of max_num_seqs
    backoff_factor: float = 0.5  # multiplicative decrease of max_num_seqs
    chunk_factor: float = 2.0  # prefill_chunk_size is multiplied or divided by this
    # windows, none overlapping the last counted and at most a window apart, that must breach before a mild
    # breach is acted on
    confirm_breaches: int = 2
    severe_ratio: float = 1.5  # a p99 this far over its SLO is acted on at once
    worse_tolerance: float = 0.1  # a correction is "worse" if the p99/SLO ratio it aimed at grows by more
    retry_after_s: float = 600.0  # a setting that made things worse waits this long (doubling) to be retried
    # ... but only while the load is alike: a failed setting blocks itself while the prompt tokens per
    # request stay within this factor of what they were when it failed (a phase of long documents may need
    # the large chunk a phase of short chats rejected)
    mix_factor: float = 1.5

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen dataclass)
        set_("max_num_seqs_bounds", _bounds("max_num_seqs_bounds", self.max_num_seqs_bounds))
        set_("prefill_chunk_size_bounds", _bounds("prefill_chunk_size_bounds", self.prefill_chunk_size_bounds))
        if self.mode not in MODES:
            raise InvalidPolicyError("mode", f"must be one of {', '.join(MODES)}, got {self.mode!r}")
        for name in ("ttft_p99_ms", "itl_p99_ms", "interval_s", "window_s", "severe_ratio", "chunk_factor",
                     "mix_factor"):
            _positive(name, getattr(self, name))
        for name in ("max_preemption_rate", "max_error_rate", "min_waiting", "worse_tolerance", "retry_after_s"):
            _non_negative(name, getattr(self, name))
        if self.cooldown_s is not None:
            _non_negative("cooldown_s", self.cooldown_s)
        for name in ("min_samples", "seqs_step", "confirm_breaches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidPolicyError(name, f"must be an integer >= 1, got {value!r}")
        for name in ("headroom", "kv_pressure", "backoff_factor", "full_batch"):
            value = getattr(self, name)
            _number(name, value)
            if not 0 < value < 1:
                raise InvalidPolicyError(name, f"must be strictly between 0 and 1, got {value!r}")
        for name in ("chunk_factor", "severe_ratio", "mix_factor"):
            if getattr(self, name) <= 1:
                raise InvalidPolicyError(name, f"must be above 1, got {getattr(self, name)!r}")

    @property
    def cooldown(self) -> float:
        """Least seconds between two changes (cooldown_s, else one window)."""
        return self.window_s if self.cooldown_s is None else self.cooldown_s

    @property
    def headroom_line(self) -> float:
        """The share of an SLO a p99 must stay under to count as having headroom: 1 - headroom."""
        return 1 - self.headroom

    def replace(self, **changes) -> TuningPolicy:
        return dataclasses.replace(self, **changes)


def _number(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise InvalidPolicyError(name, f"must be a number, got {value!r}")


def _positive(name: str, value) -> None:
    _number(name, value)
    if value <= 0:
        raise InvalidPolicyError(name, f"must be above 0, got {value!r}")


def _non_negative(name: str, value) -> None:
    _number(name, value)
    if value < 0:
        raise InvalidPolicyError(name, f"must be 0 or more, got {value!r}")
