"""The step load of the tuning benchmark and the figures of one run, measured from the client.

A load is a list of phases, each a Poisson arrival rate held for some seconds (low -> high -> low).
Requests mix long prompts (chunked prefill matters) and short ones, in a share that each phase may set
(the traffic's mix shifts, not only its rate), with outputs of a few dozen tokens
forced by `ignore_eos` + `max_tokens` (long prompts may have outputs of their own: a document and a short
answer); arrivals and requests come from one seed, so every run sends the
same requests at the same offsets. `send_load` plays it against a server through `iterserve bench`'s
client (one streaming request per arrival, each recorded as a `RequestRecord`).

Figures (pure, from the records):
- goodput: `iterserve.bench.report.goodput` with SLO {ttft, itl}: a request is good when it
  succeeded, its TTFT is within the TTFT SLO and its slowest inter-token gap within the ITL SLO;
  divided by the load's duration (the same for every run, so goodputs compare as counts of good requests).
- windows: the load's time cut into fixed windows; a window is within SLO when the p99 TTFT of the
  requests that ARRIVED in it (a request that never got a first token counts as infinitely late) and the
  p99 of the inter-token gaps that ENDED in it are both within their SLOs. Attributing TTFT to arrival
  time charges a queue to the load that built it and leaves no request unmeasured.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass, replace

import httpx
import numpy as np

from iterserve.bench.client import RequestRecord, Target, fetch_models, probe_target, run_clock, stream_request
from iterserve.bench.report import goodput, itls, meets_slo
from iterserve.bench.workload import LengthDist, RequestSpec, WorkloadSpec, generate_requests


@dataclass(frozen=True)
class Phase:
    rate: float  # requests per second (Poisson)
    duration_s: float
    long_share: float | None = None  # this phase's share of long prompts; None: the load's `long_share`


@dataclass(frozen=True)
class StepLoad:
    phases: tuple[Phase, ...]
    long_prompt: tuple[int, int] = (280, 320)  # tokens, both ends included
    short_prompt: tuple[int, int] = (20, 40)
    long_share: float = 0.5
    output: tuple[int, int] = (32, 96)
    long_output: tuple[int, int] | None = None  # long prompts' outputs (a document and a short answer); None: `output`
    seed: int = 0

    @property
    def duration_s(self) -> float:
        return sum(p.duration_s for p in self.phases)

    def describe(self) -> dict:
        return {"phases": [{"rate": p.rate, "duration_s": p.duration_s, "long_share": self.share_in(p)}
                           for p in self.phases],
                "long_prompt": list(self.long_prompt), "short_prompt": list(self.short_prompt),
                "long_share": self.long_share, "output": list(self.output),
                "long_output": list(self.long_output or self.output), "seed": self.seed}

    def share_in(self, phase: Phase) -> float:
        return self.long_share if phase.long_share is None else phase.long_share

    def phase_at(self, t: float) -> Phase:
        end = 0.0
        for phase in self.phases:
            end += phase.duration_s
            if t < end:
                return phase
        return self.phases[-1]

    def arrivals(self) -> list[float]:
        """Arrival offsets (s): a Poisson process whose rate steps at each phase boundary."""
        rng = random.Random(self.seed + 1)
        out, start = [], 0.0
        for phase in self.phases:
            t, end = start, start + phase.duration_s
            while phase.rate > 0:
                t += rng.expovariate(phase.rate)
                if t >= end:
                    break
                out.append(t)
            start = end  # memoryless: restarting the clock at the boundary keeps each phase Poisson
        return out

    def schedule(self) -> list[tuple[float, RequestSpec]]:
        """(arrival offset, request) for the whole load."""
        def requests(prompt: tuple[int, int], output: tuple[int, int], seed: int):
            spec = WorkloadSpec("random", input_len=LengthDist("uniform", *prompt),
                                output_len=LengthDist("uniform", *output), seed=seed)
            return generate_requests(spec, None)

        long = requests(self.long_prompt, self.long_output or self.output, self.seed * 2 + 100)
        short = requests(self.short_prompt, self.output, self.seed * 2 + 101)
        pick = random.Random(self.seed + 2)
        out = []
        for i, at in enumerate(self.arrivals()):
            kind, source = ("long", long) if pick.random() < self.share_in(self.phase_at(at)) else ("short", short)
            out.append((at, replace(next(source), index=i, kind=kind)))
        return out


async def find_target(client: httpx.AsyncClient, url: str, probe: RequestSpec) -> Target:
    models = await fetch_models(client, url, None)
    return await probe_target(client, Target(url=url, model=models[0]["id"]), probe)


async def asend_load(url: str, load: StepLoad, drain_s: float = 30.0, timeout_s: float = 300.0,
                     on_start=None, route=None) -> list[RequestRecord]:
    """Play `load` against `url`; requests still running `drain_s` after the last arrival are cancelled
    (recorded as such). `on_start(t0)` is called with the run's perf_counter origin just before the
    first arrival (the tuner's clock starts there). `route()`, when given, names the URL of each request
    as it is sent (a Service's endpoint of the moment); `url` then only answers the first probe."""
    schedule = load.schedule()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s, connect=10)) as client:
        target = await find_target(client, url, schedule[0][1])
        records: list[RequestRecord] = []
        tasks: list[asyncio.Task] = []
        t0 = time.perf_counter()
        now = run_clock(t0)
        if on_start is not None:
            on_start(t0)
        for at, spec in schedule:
            if (delay := at - now()) > 0:
                await asyncio.sleep(delay)
            record = RequestRecord(index=spec.index, kind=spec.kind, max_tokens=spec.max_tokens, start=now(),
                                   input_len=spec.input_len)
            records.append(record)
            to = target if route is None else replace(target, url=route())
            tasks.append(asyncio.create_task(stream_request(client, to, spec, record, t0, timeout_s)))
        if (delay := load.duration_s - now()) > 0:
            await asyncio.sleep(delay)
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=drain_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return records


def send_load(url: str, load: StepLoad, drain_s: float = 30.0, on_start=None, route=None) -> list[RequestRecord]:
    return asyncio.run(asend_load(url, load, drain_s, on_start=on_start, route=route))


def p99(values: list[float]) -> float | None:
    """numpy's p99 (linear between closest ranks); infinite when the ranks it interpolates between reach a
    request that never got a first token (numpy itself would answer nan there: inf - inf)."""
    if not values:
        return None
    ordered = sorted(values)
    if math.isinf(ordered[math.ceil(0.99 * (len(ordered) - 1))]):
        return math.inf
    return float(np.percentile(np.asarray(ordered, dtype=float), 99))


def window_figures(records: list[RequestRecord], duration_s: float, window_s: float,
                   slo_ms: dict[str, float]) -> list[dict]:
    """Per window of the load: p99 TTFT (by arrival), p99 ITL (by gap end), and whether both met the SLO.
    A window without a single sample of either is left undecided (`within_slo` None)."""
    n = max(1, math.ceil(duration_s / window_s - 1e-9))
    ttfts: list[list[float]] = [[] for _ in range(n)]
    gaps: list[list[float]] = [[] for _ in range(n)]
    for r in records:
        w = int(r.start // window_s)
        if 0 <= w < n:
            ttfts[w].append(r.first_token - r.start if r.first_token is not None and r.ok else math.inf)
        for end, gap in zip(r.chunk_times[1:], itls(r), strict=True):
            w = int(end // window_s)
            if 0 <= w < n:
                gaps[w].append(gap)
    out = []
    for i in range(n):
        t, g = p99(ttfts[i]), p99(gaps[i])
        verdict = None
        if ttfts[i] or gaps[i]:
            verdict = all(v is None or v * 1000 <= slo_ms[k] for k, v in (("ttft", t), ("itl", g)))
        out.append({"start_s": i * window_s, "num_arrivals": len(ttfts[i]), "num_gaps": len(gaps[i]),
                    "ttft_p99_ms": _ms(t), "itl_p99_ms": _ms(g), "within_slo": verdict})
    return out


def _ms(seconds: float | None) -> float | None:
    if seconds is None:
        return None
    return round(seconds * 1000, 1) if math.isfinite(seconds) else math.inf


def share_within(windows: list[dict]) -> float | None:
    """Share of the decided windows that met the SLO (None when no window was decided)."""
    return share_decided([w["within_slo"] for w in windows])


def share_decided(verdicts: list[bool | None]) -> float | None:
    """Share of True among the verdicts that are not None (None when every one is)."""
    decided = [v for v in verdicts if v is not None]
    return sum(decided) / len(decided) if decided else None


def run_figures(records: list[RequestRecord], load: StepLoad, window_s: float, slo_ms: dict[str, float]) -> dict:
    """Goodput, windows within SLO, and the plain counts of one run."""
    good = goodput(records, slo_ms, load.duration_s)
    windows = window_figures(records, load.duration_s, window_s, slo_ms)
    ok = [r for r in records if r.ok]
    return {"num_requests": len(records), "num_completed": len(ok),
            "num_cancelled": sum(r.error_kind == "cancelled" for r in records),
            "num_good": good["num_good"], "goodput_rps": good["request_rate"], "attainment": good["attainment"],
            "windows_within_slo": share_within(windows), "windows": windows,
            "ttft_p99_ms": _ms(p99([r.first_token - r.start for r in ok if r.first_token is not None])),
            "itl_p99_ms": _ms(p99([g for r in ok for g in itls(r)])),
            "requests": [request_summary(r, slo_ms) for r in records]}


def request_summary(r: RequestRecord, slo_ms: dict[str, float]) -> dict:
    """What goodput read of one request (kept in the JSON so every figure can be recomputed)."""
    first = r.first_token - r.start if r.first_token is not None else None
    return {"index": r.index, "kind": r.kind, "start_s": r.start, "ttft_ms": _ms(first),
            "max_itl_ms": _ms(max(itls(r), default=None)), "error": r.error_kind,
            "good": r.ok and all(meets_slo(r, slo_ms).values())}


def num_good_before(figures: dict, until_s: float) -> tuple[int, int]:
    """(good, sent) among the requests of a run that arrived before `until_s`."""
    early = [q for q in figures["requests"] if q["start_s"] < until_s]
    return sum(q["good"] for q in early), len(early)
