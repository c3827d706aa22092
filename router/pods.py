"""The router's view of its pods: which exist (discovery), which answer (health), how loaded each is.

Discovery is a static `--endpoints` list, or the A records of a headless Service (`--dns-name`), which
Kubernetes fills with the addresses of its ready pods alone: no API access, no RBAC, and a pod leaves
the answer as soon as its readiness fails. Each pod's /metrics is scraped every `interval`: the scrape
is the health check too. A pod that reports `iterserve:draining 1` is skipped at once; one whose scrapes
fail (no answer within `timeout`, or not 200) `failure_threshold` times in a row is skipped until a scrape
succeeds again: one slow scrape from a pod busy with a long prefill, or from a busy machine, is not a dead
pod, and with one pod it would turn every client away (a readiness probe's failureThreshold, for the same
reason). A connection that fails while proxying is firmer evidence and marks the pod down at once. The
in-flight counts are the router's own, updated as requests start and end.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
import urllib.parse
from dataclasses import dataclass, field

import aiohttp

from iterserve.common import wire
from iterserve.router.policy import PodLoad

logger = logging.getLogger("iterserve.router")
DRAINING = "iterserve:draining"


def parse_load(text: str) -> dict[str, float]:
    """The load gauges in a pod's Prometheus text, summed over their series (one per model)."""
    wanted = (wire.WAITING, wire.RUNNING, wire.KV_USAGE, wire.PROMPT_TOKENS_PENDING, DRAINING)
    values = dict.fromkeys(wanted, 0.0)
    for line in text.splitlines():
        if not line.startswith(("vllm:", "iterserve:")):  # cheap: comments and other metrics leave here
            continue
        head, _, value = line.rpartition(" ")  # `name{labels} value`: prometheus_client writes no timestamp
        name = head.split("{", 1)[0]
        if name in values:
            try:
                values[name] += float(value)
            except ValueError:
                continue
    return values


@dataclass
class Pod:
    url: str
    healthy: bool = False  # only a successful scrape makes a pod routable
    listed: bool = True  # discovery still names it: one it has dropped finishes its requests, takes no new ones
    last_ok: float = 0.0
    failures: int = 0
    load: PodLoad = field(init=False)  # what the policies read; the in-flight count is updated in place
    host: str = field(init=False)  # where the router's connections go (router/upstream.py)
    port: int = field(init=False)

    def __post_init__(self) -> None:
        self.load = PodLoad(self.url)
        where = urllib.parse.urlsplit(self.url)
        self.host, self.port = where.hostname or "", where.port or 80


class Discovery:
    """Where the pods are: a fixed list, or the addresses a DNS name resolves to (a headless Service)."""

    def __init__(self, endpoints: list[str] | None = None, dns_name: str | None = None,
                 port: int = wire.HTTP_PORT) -> None:
        if bool(endpoints) == bool(dns_name):
            raise ValueError("give either --endpoints or --dns-name")
        self.endpoints = [e.rstrip("/") for e in endpoints or []]
        for url in self.endpoints:
            where = urllib.parse.urlsplit(url)
            if where.scheme != "http" or not where.hostname or where.path:
                raise ValueError(f"an endpoint is a pod's base URL, http://host:port (the router speaks plain "
                                 f"HTTP to pods): {url!r}")
        self.dns_name, self.port = dns_name, port

    async def urls(self) -> list[str]:
        if self.endpoints:
            return self.endpoints
        infos = await asyncio.get_running_loop().getaddrinfo(self.dns_name, self.port, type=socket.SOCK_STREAM)
        hosts = sorted({str(info[4][0]) for info in infos})
        return [f"http://[{h}]:{self.port}" if ":" in h else f"http://{h}:{self.port}"
                for h in hosts]


class PodSet:
    def __init__(self, discovery: Discovery, interval: float = 0.2, timeout: float = 1.0,
                 discovery_interval: float = 2.0, failure_threshold: int = 3) -> None:
        self.discovery = discovery
        self.interval, self.timeout, self.discovery_interval = interval, timeout, discovery_interval
        self.failure_threshold = failure_threshold
        self.pods: dict[str, Pod] = {}
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task | None = None

    def healthy(self, exclude=()) -> list[Pod]:
        return [p for p in self.pods.values() if p.healthy and p.listed and p.url not in exclude]

    def mark_down(self, pod: Pod, why: str) -> None:
        if pod.healthy:
            logger.warning("pod %s is down (%s): skipped until it answers again", pod.url, why)
        pod.healthy = False

    async def refresh(self) -> None:
        """Discover, then scrape every pod once."""
        try:
            urls = await self.discovery.urls()
        except OSError as e:  # DNS unreachable for a moment: keep the pods known so far
            logger.warning("discovery failed (%s): keeping %d known pods", e, len(self.pods))
        else:
            for url in urls:
                self.pods.setdefault(url, Pod(url)).listed = True
            for url in set(self.pods) - set(urls):
                # a pod leaves the headless Service's answer as it starts terminating (its preStop hook
                # runs before SIGTERM): no new requests go there, those in flight finish on their connection
                self.pods[url].listed = False
                if self.pods[url].load.in_flight == 0:
                    del self.pods[url]
        await asyncio.gather(*(self._scrape(p) for p in list(self.pods.values())))

    async def _scrape(self, pod: Pod) -> None:
        assert self._session is not None  # made by start() before the first refresh
        covered = list(pod.load.unscraped)  # requests the pod counts by the time this scrape reaches it
        try:
            async with self._session.get(pod.url + "/metrics") as r:
                status, text = r.status, await r.text()
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            self._failed(pod, f"scrape: {type(e).__name__}")
            return
        if status != 200:
            self._failed(pod, f"scrape: HTTP {status}")
            return
        load = parse_load(text)
        if load[DRAINING]:
            self.mark_down(pod, "draining")
            return
        pod.load.waiting, pod.load.running, pod.load.kv_usage = (load[wire.WAITING], load[wire.RUNNING],
                                                              load[wire.KV_USAGE])
        pod.load.prompt_tokens_pending, pod.load.ended = load[wire.PROMPT_TOKENS_PENDING], 0
        for request in covered:
            pod.load.unscraped.pop(request, None)
        if not pod.healthy:
            logger.info("pod %s is up", pod.url)
        pod.healthy, pod.last_ok, pod.failures = True, time.monotonic(), 0

    def _failed(self, pod: Pod, why: str) -> None:
        pod.failures += 1
        if pod.failures >= self.failure_threshold:
            self.mark_down(pod, f"{why}, {pod.failures} scrapes in a row")

    async def _loop(self) -> None:
        next_discovery = 0.0
        while True:
            start = time.monotonic()
            try:
                if start >= next_discovery:
                    await self.refresh()
                    next_discovery = start + self.discovery_interval
                else:
                    await asyncio.gather(*(self._scrape(p) for p in list(self.pods.values())))
            except Exception:  # a bug here must not stop health checks for good
                logger.exception("pod refresh failed")
            await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - start)))

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout))
        await self.refresh()
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        if self._session is not None:
            await self._session.close()
