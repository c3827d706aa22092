"""What the fleet simulator (benchmarks/autoscaling.py) runs: a `Scenario` is the pods' latency model, the
SLO and tuner policy, the tick and window, the load's phases and the pods' start time, in one value.

Three scenarios:
- `TUNING_TESTS`: the latency model the tuning tests use (tests/tuning_latency_model.py's defaults: a pod
  finishing 20 requests/s within a 1.5-s TTFT and 40-ms ITL SLO), 30-s ticks on 30-s windows, pods ready
  60 s after the ask; the table of record in docs/benchmarks-autoscaling.md.
- `live_fit(LIVE_CALIBRATION)`: the same model fitted to the live pods of benchmarks/autoscaling_live.py
  (SmolLM2-135M on one thread each), from what its calibration measures: the inter-token gap alone, a long
  prompt's TTFT alone and the requests/s one pod finishes under overload at the starting knobs. The
  operator's cadence there (a tick every 5 s on a 20-s window), its SLOs (8x and 16x the figures alone), its
  load (0.4, 1.4, 0.4 x one pod for 90, 180, 150 s per 2 pods of F), pods Ready ~7 s after the ask, its
  60-s scale-down window and the HPA's 15-s sync. `shared_cores` (the live machine: two pods and everything
  else on 2 cores) slows each pod when two run, by what the calibration's two-pod run measured.
- `live_fit_dips`: the same pods, the peak three times as long and broken by two 30-s dips to the low
  load (a step down that does not last: what the scale-down stabilization window guards against).

The fit (`fit_model`) solves the model's own formulas (with `exact_prefill`: on one CPU thread a request's
prompt costs ~3 times its decode, so prefill is most of a pod's work) for its three step-time constants:
a decode step of one sequence is the gap alone (t0 + per_seq); a prompt token costs what the long prompt's
TTFT alone has beyond its prefill steps' gaps; and the model's capacity at the starting knobs on the load's
mean request is the one-pod overload rate. tests/test_fleet_scenario.py checks that the fitted
model gives those figures back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from iterserve.common.wire import Knobs
from iterserve.operator.tuning.policy import KnobBounds, TuningPolicy
from tests.tuning_latency_model import LatencyModel


@dataclass(frozen=True)
class Scenario:
    name: str
    model: dict  # LatencyModel's parameters (its seed is the simulator's)
    policy: TuningPolicy  # the SLO and the tuner's policy; its interval is the tick, its window the window
    start: Knobs  # every run starts from these
    phases: tuple[tuple[float, float], ...]  # (requests/s per unit of the fleet size F, seconds)
    settle_s: float  # "after convergence" leaves out this long after each step of the load
    start_s: float  # a new pod is ready this long after the ask
    scale_down_s: float = 300.0  # spec.autoscaling's scale-down stabilization (and the HPA's)
    hpa_period_s: float | None = None  # the HPA's sync period; None: every tick
    # each pod's speed when n pods share the machine's cores (n -> speed, 1.0 if absent): the live machine
    shared_cores: dict[int, float] = field(default_factory=dict)

    @property
    def tick_s(self) -> float:
        return self.policy.interval_s

    @property
    def window_ticks(self) -> int:
        """Ticks in one window (the operator's sliding window; the SLO is judged on windows this long)."""
        return max(1, round(self.policy.window_s / self.policy.interval_s))

    def ticks(self, seconds: float) -> int:
        return round(seconds / self.tick_s)

    def slo_capacity(self) -> float:
        """Requests/s one pod finishes within the SLO at its best knobs (noise-free, steady state)."""
        m, p = LatencyModel(**self.model), self.policy
        best = 0.0
        seqs_range = range(p.max_num_seqs_bounds.min, p.max_num_seqs_bounds.max + 1)
        chunk = p.prefill_chunk_size_bounds.min
        while chunk <= p.prefill_chunk_size_bounds.max:
            knobs = Knobs(max_num_seqs=1, max_num_batched_tokens=max(chunk, self.start.max_num_batched_tokens),
                          prefill_chunk_size=chunk)
            for seqs in seqs_range:
                k = replace(knobs, max_num_seqs=seqs)
                lo, hi = 0.0, m.steady(k, 0.0, saturated=True).capacity
                if not m.meets(k, lo + 1e-6, p.ttft_p99_ms / 1e3, p.itl_p99_ms / 1e3):
                    continue
                for _ in range(40):
                    mid = (lo + hi) / 2
                    lo, hi = (mid, hi) if m.meets(k, mid, p.ttft_p99_ms / 1e3, p.itl_p99_ms / 1e3) else (lo, mid)
                best = max(best, lo)
            chunk *= 2
        return best


TUNING_TESTS = Scenario(
    name="tuning-tests",
    model={},
    policy=TuningPolicy(ttft_p99_ms=1500, itl_p99_ms=40, max_num_seqs_bounds=KnobBounds(1, 64),
                        prefill_chunk_size_bounds=KnobBounds(16, 512), interval_s=30.0, window_s=30.0, seqs_step=4,
                        min_samples=20),
    start=Knobs(max_num_seqs=4, max_num_batched_tokens=512, prefill_chunk_size=256),
    # 0.25F, F, 0.5F, 0.25F pods' worth at 0.9 of the 20 requests/s one pod carries within the SLO
    phases=((0.25 * 18.0, 600.0), (18.0, 1200.0), (0.5 * 18.0, 1200.0), (0.25 * 18.0, 900.0)),
    settle_s=300.0, start_s=60.0)


@dataclass(frozen=True)
class Calibration:
    """What benchmarks/autoscaling_live.py's calibration prints, and the load's shape it runs."""

    itl_s: float  # the inter-token gap alone
    long_ttft_s: float  # a long prompt's TTFT alone
    long_prompt: float  # its tokens (the middle of the load's range)
    one_pod_rps: float  # requests/s one pod finishes under overload, at the starting knobs
    two_pods_rps: float  # ... two pods on the same machine
    mean_prompt: float  # the load's mix: half chats of 20-40 tokens, half documents of 280-320
    mean_output: float  # half 32-96 tokens, half 8-16
    start: Knobs
    ready_s: float  # a scale-out's pods Ready after the ask


# benchmarks/autoscaling_live.py, the 16:01 UTC round of 2026-12-04 (docs/benchmarks-autoscaling.md); pods
# Ready 6.0-8.3 s after the ask (median 6.8) in the 2026-12-06 09:42 rounds, the start-up cut since included
LIVE_CALIBRATION = Calibration(itl_s=0.0130, long_ttft_s=0.368, long_prompt=300, one_pod_rps=3.65, two_pods_rps=6.45,
                               mean_prompt=165, mean_output=38,
                               start=Knobs(max_num_seqs=16, max_num_batched_tokens=2048, prefill_chunk_size=128),
                               ready_s=7.0)


def fit_model(cal: Calibration) -> dict:
    """LatencyModel parameters (`exact_prefill`) whose formulas give back the calibration's gap, the long
    prompt's TTFT and the one-pod capacity."""
    chunk = cal.start.prefill_chunk_size
    # a prompt alone: its prefill steps' fixed cost and its tokens; the long prompt's TTFT gives the latter
    per_prefill_token = (cal.long_ttft_s - math.ceil(cal.long_prompt / chunk) * cal.itl_s) / cal.long_prompt
    base: dict[str, Any] = dict(prompt=round(cal.mean_prompt), output=round(cal.mean_output),
                                per_prefill_token=per_prefill_token,
                                kv_tokens=10**7, exact_prefill=True)  # the live pods never preempted

    def capacity(per_seq: float) -> float:
        model = LatencyModel(**base, t0=cal.itl_s - per_seq, per_seq=per_seq)
        return model.steady(cal.start, 0.0, saturated=True).capacity

    lo, hi = 0.0, cal.itl_s  # capacity falls as per_seq grows (t0 + per_seq held at the gap)
    if not capacity(hi) <= cal.one_pod_rps <= capacity(lo):
        raise ValueError(f"no per-sequence cost gives {cal.one_pod_rps} requests/s at {cal.start}")
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if capacity(mid) > cal.one_pod_rps else (lo, mid)
    return {**base, "t0": cal.itl_s - hi, "per_seq": hi}


def live_fit(cal: Calibration = LIVE_CALIBRATION, shared_cores: bool = False) -> Scenario:
    """benchmarks/autoscaling_live.py's setup on pods of the model fitted to its calibration; phases per 2
    pods of F (F = 2 is the live run: its peak is 1.4 x what one pod finishes)."""
    per_f = cal.one_pod_rps / 2
    return Scenario(
        name="live-fit" + (", shared cores" if shared_cores else ""),
        model=fit_model(cal),
        policy=TuningPolicy(ttft_p99_ms=math.ceil(8 * cal.long_ttft_s * 1e3),
                            itl_p99_ms=math.ceil(16 * cal.itl_s * 1e3), max_num_seqs_bounds=KnobBounds(4, 64),
                            prefill_chunk_size_bounds=KnobBounds(64, 512), interval_s=5.0, window_s=20.0),
        start=cal.start,
        phases=((0.4 * per_f, 90.0), (1.4 * per_f, 180.0), (0.4 * per_f, 150.0)),
        settle_s=60.0, start_s=cal.ready_s, scale_down_s=60.0, hpa_period_s=15.0,
        shared_cores={2: cal.two_pods_rps / (2 * cal.one_pod_rps)} if shared_cores else {})


def live_fit_dips(cal: Calibration = LIVE_CALIBRATION) -> Scenario:
    """`live_fit` with the peak three times as long and broken twice by 30 s of the low load: a step down
    that does not last. What a scale-down stabilization window is for, and what a stepped load cannot
    tell from a step that does (each dip's first seconds are the step's)."""
    sc = live_fit(cal)
    (low, first), (high, _), last = sc.phases
    return replace(sc, name="live-fit-dips", phases=((low, first), (high, 150.0), (low, 30.0), (high, 150.0),
                                                     (low, 30.0), (high, 150.0), last))


SCENARIOS = {"tuning-tests": lambda: TUNING_TESTS, "live-fit": live_fit,
             "live-fit-shared": lambda: live_fit(shared_cores=True), "live-fit-dips": live_fit_dips}
