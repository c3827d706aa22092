"""Load generation: a closed loop at fixed concurrency, an open loop of Poisson (or gamma) arrivals, and
sweeps over either. This is also the Python API other tools (the operator's tuner tests) use to make
load::

    import threading
    from iterserve.bench.load import BenchConfig, run_bench
    from iterserve.bench.workload import WorkloadSpec, parse_length

    config = BenchConfig(url="http://127.0.0.1:8000", rate=4.0, num_requests=None, duration_s=60,
                         workload=WorkloadSpec("random", output_len=parse_length("32")))
    stop = threading.Event()
    worker = threading.Thread(target=lambda: results.append(run_bench(config, stop)))
    ...                     # run_bench blocks; in asyncio code, await arun_bench(config, stop) instead
    stop.set()              # no new requests; the ones in flight are cancelled and recorded as such
    result = results[0]     # BenchResult: result.runs[0].records, .summary(slo), .to_json(), .save(dir)

`num_requests=None` sends until `duration_s` passes (in-flight requests then finish) or `stop` is set.
Every request comes from the seeded workload, and open-loop arrival gaps from the seed + 1, so two runs
with the same configuration send the same requests at the same offsets. The loop decides only when each
request goes; a `RequestSender` sends it and records what happened (`BenchConfig.sender`; by default
`HttpSender`, OpenAI's streaming HTTP API).
"""

from __future__ import annotations

import asyncio
import datetime
import math
import random
import threading
import time
from dataclasses import dataclass, field, fields, replace
from typing import Protocol

import httpx

from iterserve.bench.client import BenchError, HttpSender, RequestRecord, Target, run_clock
from iterserve.bench.metrics_scraper import MetricsScraper, knob_values, summarize_scrapes
from iterserve.bench.result import BenchResult, RunResult
from iterserve.bench.workload import RequestSpec, WorkloadSpec, generate_requests

SWEEP_PARAMS = ("concurrency", "rate")
FINISHED = "vllm:request_success_total"  # summed over finished_reason


class RequestSender(Protocol):
    """What the load loop needs of the thing that sends its requests (`HttpSender`: OpenAI's streaming
    HTTP API; the tests' recording sender): the server's models, a probe settling which request features
    the server takes, and one request sent and recorded. Each call runs in the load loop's event loop;
    the loop alone decides when requests go and how many are in flight."""

    async def models(self, url: str, api_key: str | None) -> list[dict]:
        """OpenAI's /v1/models entries ("id", optionally "max_model_len"); BenchError when unreachable."""

    async def probe(self, target: Target, spec: RequestSpec) -> Target:
        """`target` with each optional feature the server refuses turned off, found with 1-token requests;
        BenchError when the server takes no request shape at all."""

    async def send(self, target: Target, spec: RequestSpec, record: RequestRecord, t0: float,
                   timeout: float) -> None:
        """Send `spec`, filling `record` (times: seconds since `t0`, perf_counter) as it is answered; a
        failure is recorded, not raised. Raises only CancelledError, after recording the cancellation."""


@dataclass(frozen=True)
class BenchConfig:
    url: str
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    model: str | None = None  # None: the server's first model
    endpoint: str = "completions"  # or "chat"
    num_requests: int | None = 100  # per load level; None: until duration_s or stop
    duration_s: float | None = None  # per load level: no new request after this
    concurrency: int | None = None  # closed loop
    rate: float | None = None  # open loop, requests per second (math.inf: all at once)
    burstiness: float = 1.0  # gamma shape of arrival gaps: 1 is Poisson, < 1 burstier
    sweep: tuple[float, ...] = ()  # values of concurrency (or rate, whichever is set) to run in turn
    timeout_s: float = 600.0  # per request
    api_key: str | None = None
    admin_token: str | None = None
    metrics_interval_s: float = 1.0
    slo_ms: dict[str, float] = field(default_factory=dict)
    settings: dict[str, str] = field(default_factory=dict)  # declared by the user, e.g. policy=static
    temperature: float = 0.0
    sender: RequestSender | None = None  # None: an HttpSender over the run's own connection pool

    def __post_init__(self):
        object.__setattr__(self, "url", self.url.rstrip("/"))
        problems = []
        if not self.url.startswith(("http://", "https://")):
            problems.append(f"--url must start with http:// or https://, got {self.url!r}")
        if (self.concurrency is None) == (self.rate is None):
            problems.append("give exactly one of --concurrency and --rate (with --sweep: the one to vary)")
        if self.concurrency is not None and self.concurrency < 1:
            problems.append(f"--concurrency must be >= 1, got {self.concurrency}")
        if self.rate is not None and not self.rate > 0:
            problems.append(f"--rate must be > 0 requests/s, got {self.rate}")
        if not self.burstiness > 0:
            problems.append(f"--burstiness must be > 0, got {self.burstiness}")
        if self.num_requests is not None and self.num_requests < 1:
            problems.append(f"--requests must be >= 1, got {self.num_requests}")
        if self.duration_s is not None and not self.duration_s > 0:
            problems.append(f"--duration must be > 0 seconds, got {self.duration_s}")
        if self.endpoint not in ("completions", "chat"):
            problems.append(f"--endpoint must be completions or chat, got {self.endpoint!r}")
        if not self.timeout_s > 0 or not self.metrics_interval_s > 0:
            problems.append("--timeout and --metrics-interval must be > 0")
        if any(not v > 0 or (self.concurrency is not None and v != int(v)) for v in self.sweep):
            problems.append(f"--sweep values must be > 0 (whole numbers for concurrency): {list(self.sweep)}")
        if problems:
            raise ValueError("; ".join(problems))

    def loads(self) -> list[dict]:
        one = self.concurrency if self.concurrency is not None else self.rate
        assert one is not None  # __post_init__ refused a config without exactly one of them
        values = self.sweep or (one,)
        if self.concurrency is not None:
            return [{"concurrency": int(v)} for v in values]
        return [{"rate": json_number(float(v)), "burstiness": self.burstiness} for v in values]

    def describe(self) -> dict:
        # not asdict(): it would deep-copy the sender (a connection pool, an engine)
        d = {f.name: getattr(self, f.name) for f in fields(self)
             if f.name not in ("workload", "api_key", "admin_token", "sender")}
        d["slo_ms"], d["settings"] = dict(self.slo_ms), dict(self.settings)
        if self.sender is not None:  # the default (HTTP) is not written, as before the seam existed
            d["sender"] = type(self.sender).__name__
        d["workload"] = self.workload.describe()
        d["sweep"] = [json_number(v) for v in self.sweep]
        d["rate"] = json_number(self.rate)
        return d


def json_number(value: float | None) -> float | str | None:
    """JSON has no infinity: an unbounded rate is written "inf" (float("inf") reads it back)."""
    return "inf" if value == math.inf else value


class Progress:
    """What the load generator reports while it runs (the CLI draws a bar; the default does nothing)."""

    def start_run(self, label: str, total: int | None) -> None: ...

    def finish_request(self, record: RequestRecord) -> None: ...


def run_bench(config: BenchConfig, stop: threading.Event | None = None, progress: Progress | None = None
              ) -> BenchResult:
    """Run the whole benchmark (every load level) in a fresh event loop; blocking, thread-safe."""
    return asyncio.run(arun_bench(config, stop, progress))


async def arun_bench(config: BenchConfig, stop: threading.Event | None = None,
                     progress: Progress | None = None, result: BenchResult | None = None) -> BenchResult:
    """The benchmark as a coroutine. Raises BenchError before any load if the server is unusable;
    once load has started, failures are recorded and the partial result is returned. Pass `result`
    to see records as they arrive (the CLI saves it if it is interrupted)."""
    stop = stop or threading.Event()
    progress = progress or Progress()
    result = result or BenchResult(config=config.describe())
    result.started_at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(config.timeout_s, connect=10)) as client:
        sender: RequestSender = config.sender or HttpSender(client)
        target, workload = await _prepare(client, sender, config, result)
        for load in config.loads():
            label = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                              for k, v in load.items() if k != "burstiness")
            run = RunResult(label=label, load=load)
            result.runs.append(run)
            await _run_level(client, sender, config, target, workload, run, stop, progress)
            if stop.is_set():
                result.interrupted = run.interrupted = True
                break
    return result


async def _prepare(client: httpx.AsyncClient, sender: RequestSender, config: BenchConfig, result: BenchResult
                   ) -> tuple[Target, WorkloadSpec]:
    models = await sender.models(config.url, config.api_key)
    if not models and config.model is None:
        raise BenchError(f"{config.url}/v1/models lists no model; pass --model")
    model = config.model or models[0]["id"]
    entry = next((m for m in models if m.get("id") == model), {})
    workload = config.workload
    if workload.max_model_len is None and isinstance(entry.get("max_model_len"), int):
        workload = replace(workload, max_model_len=entry["max_model_len"])
    target = Target(url=config.url, model=model, endpoint=config.endpoint, api_key=config.api_key,
                    ignore_eos=workload.ignore_eos, temperature=config.temperature)
    scraper = MetricsScraper(client, config.url, time.perf_counter())
    await scraper.scrape()
    target = await sender.probe(target, next(generate_requests(workload, 1)))
    if scraper.available:  # let the probe's own metrics land before the first run's "before" scrape
        await _scrape_when_counted(scraper, num_answered=1)
    scrape = scraper.scrapes[-1] if scraper.scrapes else None
    settings = {"model": model, **({"max_model_len": entry["max_model_len"]} if "max_model_len" in entry else {})}
    if scrape is not None:
        settings.update(knob_values(scrape))
        settings.update(scrape.info)
    if config.admin_token:
        settings.update(await _admin_knobs(client, config, result))
    settings.update(config.settings)
    result.server = {"url": config.url, "model": model, "settings": settings,
                     "features": {"token_id_prompts": target.token_ids, "ignore_eos": target.ignore_eos,
                                  "continuous_usage": target.continuous_usage},
                     "metrics": scraper.available, "metrics_problem": scraper.problem,
                     "max_model_len_used": workload.max_model_len}
    if workload.ignore_eos and not target.ignore_eos:
        result.problems.append("the server refused ignore_eos: output lengths are at most max_tokens, not exact")
    return target, workload


async def _admin_knobs(client: httpx.AsyncClient, config: BenchConfig, result: BenchResult) -> dict:
    try:
        r = await client.get(config.url + "/admin/scheduler", timeout=10,
                             headers={"Authorization": f"Bearer {config.admin_token}"})
        if r.status_code == 200:
            return dict(r.json().get("knobs", {}))
        result.problems.append(f"GET /admin/scheduler answered HTTP {r.status_code}; knobs read from /metrics")
    except (httpx.HTTPError, ValueError) as e:
        result.problems.append(f"GET /admin/scheduler failed ({type(e).__name__}); knobs read from /metrics")
    return {}


async def _run_level(client: httpx.AsyncClient, sender: RequestSender, config: BenchConfig, target: Target,
                     workload: WorkloadSpec, run: RunResult, stop: threading.Event, progress: Progress) -> None:
    t0 = time.perf_counter()
    now = run_clock(t0)
    scraper = MetricsScraper(client, config.url, t0, config.metrics_interval_s)
    await scraper.scrape()
    progress.start_run(run.label, config.num_requests)
    specs = generate_requests(workload, config.num_requests)
    in_flight: set[asyncio.Task] = set()

    def may_start() -> bool:
        return not stop.is_set() and (config.duration_s is None or now() < config.duration_s)

    async def send(spec: RequestSpec) -> None:
        record = RequestRecord(index=spec.index, kind=spec.kind, max_tokens=spec.max_tokens, start=now(),
                               input_len=spec.input_len)
        run.records.append(record)
        try:
            await sender.send(target, spec, record, t0, config.timeout_s)
        finally:
            progress.finish_request(record)

    async def closed_loop_worker() -> None:
        for spec in specs:  # one shared iterator: each worker takes the next request when it is free
            if not may_start():
                return
            await send(spec)

    async def open_loop() -> None:
        gaps = random.Random(workload.seed + 1)
        at = 0.0
        for spec in specs:
            await _sleep_until(at, now, stop)
            if not may_start():
                break
            task = asyncio.create_task(send(spec))
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)
            rate = float(run.load["rate"])
            if not math.isinf(rate):
                at += gaps.gammavariate(config.burstiness, 1.0 / (rate * config.burstiness))
        if in_flight:
            await asyncio.wait(set(in_flight))

    main: asyncio.Future
    if "concurrency" in run.load:
        main = asyncio.gather(*(closed_loop_worker() for _ in range(run.load["concurrency"])))
    else:
        main = asyncio.ensure_future(open_loop())
    scraping_done = asyncio.Event()
    scraping = asyncio.create_task(scraper.run(scraping_done))
    watcher = asyncio.create_task(_wait_for_thread_event(stop))
    try:
        await asyncio.wait({main, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not main.done():  # stopped: cancel what runs; each cancelled request is recorded as such
            run.interrupted = True
            main.cancel()
            for task in list(in_flight):
                task.cancel()
            await asyncio.gather(main, *in_flight, return_exceptions=True)
        scraping_done.set()
        await scraping
    if scraper.available:
        await _scrape_when_counted(scraper, sum(1 for r in run.records if r.status == 200))
        run.server = summarize_scrapes(scraper.scrapes)


async def _sleep_until(at: float, now, stop: threading.Event) -> None:
    while not stop.is_set() and (delay := at - now()) > 0:
        await asyncio.sleep(min(delay, 0.05))


async def _wait_for_thread_event(event: threading.Event) -> None:
    while not event.is_set():
        await asyncio.sleep(0.05)


async def _scrape_when_counted(scraper: MetricsScraper, num_answered: int) -> None:
    """Scrape once the server has counted the requests it answered since the first scrape (it records a
    request's metrics just after sending its last token), or after 2 s."""
    before = scraper.scrapes[0].values
    deadline = time.perf_counter() + 2.0
    while True:
        scrape = await scraper.scrape()
        if scrape is None or FINISHED not in scrape.values:
            return
        counted = scrape.values[FINISHED] - before.get(FINISHED, 0.0)
        if counted >= num_answered or time.perf_counter() > deadline:
            return
        await asyncio.sleep(0.1)
