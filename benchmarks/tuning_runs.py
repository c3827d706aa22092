"""The server, the runs and the tuner of the tuning benchmark (benchmarks/tuning.py).

One `iterserve serve` process serves every run: before each, its knobs are set through PATCH
/admin/scheduler and the script waits until no request runs or waits, so each run starts from an idle
server with the knobs it names (the knobs are read on every scheduling step; nothing else carries over
but warm caches). A tuned run drives the operator's `Tuner` directly: ticks on a timer, observations
scraped from the server's /metrics by `PodScraper`, changes applied live by PATCH, no Kubernetes.
"""

from __future__ import annotations

import asyncio
import math
import secrets
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from benchmarks.tuning_load import StepLoad, find_target, send_load
from iterserve.bench.client import RequestRecord, stream_request
from iterserve.bench.report import itls
from iterserve.common.wire import Knobs
from iterserve.operator.tuning.decide import HOLD
from iterserve.operator.tuning.observation import RUNNING, WAITING
from iterserve.operator.tuning.observe import PodScraper, parse_scrape
from iterserve.operator.tuning.pod_admin import get_scheduler, patch_scheduler
from iterserve.operator.tuning.policy import TuningPolicy
from iterserve.operator.tuning.tuner import Tuner

# where the tuned runs start: inside the tuner's default chunk bounds (16..512), which the servers' own
# defaults (common/wire.py: a whole prompt in one step) are not
START_KNOBS = Knobs(max_num_seqs=64, max_num_batched_tokens=512, prefill_chunk_size=256)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`iterserve serve` on a free loopback port with an admin token; its log goes to `log_path`."""

    def __init__(self, engine_args: list[str], log_path: Path, ready_timeout_s: float = 300.0):
        self.token = secrets.token_hex(16)
        self.url = f"http://127.0.0.1:{free_port()}"
        cmd = [sys.executable, "-m", "iterserve.server.entrypoints.cli", "serve", "--host", "127.0.0.1",
               "--port", self.url.rsplit(":", 1)[1], "--log-level", "warning", "--admin-token", self.token,
               *engine_args]
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + ready_timeout_s
        while not self._ready():
            if self.proc.poll() is not None:
                raise RuntimeError(f"iterserve serve exited with {self.proc.returncode}; see {log_path}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"iterserve serve not ready after {ready_timeout_s:g} s; see {log_path}")
            time.sleep(0.2)

    def _ready(self) -> bool:
        try:
            return httpx.get(self.url + "/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def set_knobs(self, knobs: Knobs) -> None:
        patch_scheduler(self.url, self.token, knobs.as_dict())
        assert get_scheduler(self.url, self.token)["knobs"] == knobs.as_dict()

    def wait_idle(self, timeout_s: float = 120.0) -> float:
        """Block until no request runs or waits (cancelled requests are aborted by the server); returns
        the seconds waited."""
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            g = parse_scrape(httpx.get(self.url + "/metrics", timeout=10).text, 0.0).gauges
            if g.get(RUNNING, 0.0) + g.get(WAITING, 0.0) == 0:
                return time.monotonic() - start
            time.sleep(0.5)
        raise RuntimeError(f"{self.url} still busy {timeout_s:g} s after the run")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def calibrate(server: Server, load: StepLoad, num_each: int = 2) -> dict:
    """Unloaded figures at the default knobs: `num_each` long and short requests of the load, one at a
    time after one to warm up. Returns the median TTFT of the long ones and the median inter-token gap, in ms."""
    server.set_knobs(START_KNOBS)
    schedule = [spec for _, spec in load.schedule()]
    shorts = [s for s in schedule if s.kind == "short"]
    # the first short request warms the server up and is not counted
    specs = shorts[-1:] + [s for s in schedule if s.kind == "long"][:num_each] + shorts[:num_each]

    async def one_at_a_time() -> list[RequestRecord]:
        async with httpx.AsyncClient(timeout=httpx.Timeout(300, connect=10)) as client:
            target = await find_target(client, server.url, specs[0])
            records = []
            for spec in specs:
                record = RequestRecord(index=spec.index, kind=spec.kind, max_tokens=spec.max_tokens, start=0.0)
                await stream_request(client, target, spec, record, time.perf_counter(), 300)
                if not record.ok:
                    raise RuntimeError(f"calibration request failed: {record.error}")
                records.append(record)
            return records

    records = asyncio.run(one_at_a_time())[1:]
    return {"long_ttft_ms": 1000 * statistics.median(r.first_token - r.start for r in records if r.kind == "long"),
            "itl_median_ms": 1000 * statistics.median(g for r in records for g in itls(r)),
            "num_requests": len(records)}


@dataclass
class TunerLog:
    """The ticks of one tuned run, in seconds since the load started."""

    ticks: list[dict] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def trajectory(self, initial: Knobs) -> list[dict]:
        """The knobs in force from each change on: [{t_s, max_num_seqs, prefill_chunk_size, action}]."""
        out = [{"t_s": 0.0, **_pair(initial), "action": "initial"}]
        for t in self.ticks:
            if t["changed"]:
                out.append({"t_s": t["t_s"], "max_num_seqs": t["max_num_seqs"],
                            "prefill_chunk_size": t["prefill_chunk_size"], "action": t["action"]})
        return out


def _pair(k: Knobs) -> dict:
    return {"max_num_seqs": k.max_num_seqs, "prefill_chunk_size": k.prefill_chunk_size}


def run_tuned(server: Server, load: StepLoad, policy: TuningPolicy, initial: Knobs = START_KNOBS,
              drain_s: float = 30.0) -> tuple[list[RequestRecord], TunerLog]:
    """The load from `initial` with the tuner ticking every `policy.interval_s` until the load ends."""
    server.set_knobs(initial)
    server.wait_idle()
    log = TunerLog()
    origin: list[float] = []
    started, done = threading.Event(), threading.Event()
    clock = lambda: time.perf_counter() - origin[0]  # noqa: E731 (the load's clock)
    tuner = Tuner("benchmark", "tuning", list_pods=lambda: [server.url], admin_token=server.token, policy=policy,
                  source=PodScraper(), knobs=initial, clock=clock)

    def tick_loop() -> None:
        started.wait()
        n = 0
        while not done.is_set() and (at := n * policy.interval_s) < load.duration_s:
            if (delay := at - clock()) > 0 and done.wait(delay):
                break
            record = tuner.tick()
            obs = record.observation
            log.ticks.append({"t_s": round(record.time, 2), "action": record.decision.action,
                              "changed": record.changed, **_pair(record.knobs),
                              "ttft_p99_ms": _ms(obs.ttft_p99_s if obs else None),
                              "itl_p99_ms": _ms(obs.itl_p99_s if obs else None),
                              "num_samples": obs.num_samples if obs else 0,
                              "tuned": record.decision.tuned.reason, "reason": record.decision.reason})
            log.errors += list(record.errors)
            if record.decision.action != HOLD:
                print(f"  t={record.time:5.1f} s  {record.decision.action} -> {record.knobs.max_num_seqs}/"
                      f"{record.knobs.prefill_chunk_size}: {record.decision.reason}", flush=True)
            n += 1

    def on_start(t0: float) -> None:
        origin.append(t0)
        started.set()

    thread = threading.Thread(target=tick_loop, name="tuner", daemon=True)
    thread.start()
    try:
        records = send_load(server.url, load, drain_s, on_start=on_start)
    finally:
        started.set()
        done.set()
        thread.join(60)
    return records, log


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def within_one_step(a: dict, b: dict, policy: TuningPolicy) -> bool:
    """Two settings one tuner move apart at most: max_num_seqs by one additive step or one back-off,
    prefill_chunk_size by one factor."""
    s_lo, s_hi = sorted((a["max_num_seqs"], b["max_num_seqs"]))
    c_lo, c_hi = sorted((a["prefill_chunk_size"], b["prefill_chunk_size"]))
    seqs_near = s_hi - s_lo <= policy.seqs_step or math.floor(s_hi * policy.backoff_factor) <= s_lo
    return seqs_near and c_hi <= math.ceil(c_lo * policy.chunk_factor)


def convergence_s(trajectory: list[dict], window_s: float, duration_s: float, policy: TuningPolicy) -> float | None:
    """Start of the first window from which on every setting in force stays within one step of the final
    one; None when that is only true after the load ended."""
    final = trajectory[-1]
    since = 0.0
    for i, setting in enumerate(trajectory):
        if not within_one_step(setting, final, policy):
            since = trajectory[i + 1]["t_s"]
    start = math.ceil(since / window_s - 1e-9) * window_s
    return start if start < duration_s else None
