"""The router's routing policies, pure: they read each pod's load and return a pod, nothing else.

`round-robin` is the baseline: what a Kubernetes Service gives (kube-proxy spreads connections without
looking at any pod's load), kept so that a benchmark can compare the policies through the same router,
whose own cost is then the same on every side.

`least-load` ranks pods by the work a new prompt would find ahead of it there: the prompt tokens still
to prefill, plus `REQUEST_TOKENS` for each request on the pod. A prompt's first token waits for the
prefill queued before it, so a long prompt being prefilled weighs more than a few decoding requests (a
running request adds a few ms to each step, a prompt token ~0.7 ms on one core). The prefill ahead is the
pod's `iterserve:num_prompt_tokens_pending` at the last scrape plus this router's requests in flight
there that no scrape has counted yet (their prompts estimated from the body's size), so a burst does not
land on one pod between two scrapes, and a request that has ended weighs nothing. The requests are the
larger of the router's own in-flight count (exact and fresh, but blind to other routers' traffic) and
the waiting + running requests of the pod's last scrape (every router's, but up to one scrape interval
old, less this router's requests it counted that have ended since); their maximum never counts a
request twice. A pod that exports no pending-token gauge (another server) is ranked by its requests
alone. KV-cache usage breaks ties, then a rotating start, so that idle pods share the traffic evenly.

`least-requests` is least-load without the prefill: the requests alone (KV usage, then turns, breaking
ties), as AIBrix's least-request routes; kept to measure what the pending tokens buy.

`prefix-hash` is consistent hashing with bounded load (CHWBL, as KubeAI routes): the prompt's prefix is
hashed onto a ring of virtual nodes, and the request goes to the first pod clockwise whose in-flight
count stays within `load_factor` x the average. The same prefix therefore lands on the same pod (whose
prefix cache holds it) until that pod is overloaded, and removing a pod moves only the keys it owned.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

POLICIES = ("least-load", "least-requests", "prefix-hash", "round-robin")
REQUEST_TOKENS = 32  # a request on a pod, in prompt tokens of prefill ahead (see the module's docstring)
BODY_BYTES_PER_TOKEN = 4  # a request body's size over its prompt's tokens: JSON text, ~4 characters a token


def estimated_tokens(body_bytes: int) -> float:
    """The prompt tokens of a request body of `body_bytes` bytes, for the pending-prefill count."""
    return body_bytes / BODY_BYTES_PER_TOKEN


@dataclass
class PodLoad:
    """What a policy knows of one pod: its name (the endpoint URL) and load."""

    name: str
    in_flight: int = 0  # requests this router has sent there and not finished
    waiting: float = 0.0  # vllm:num_requests_waiting at the last scrape
    running: float = 0.0  # vllm:num_requests_running at the last scrape
    kv_usage: float = 0.0  # vllm:kv_cache_usage_perc at the last scrape, 0..1
    prompt_tokens_pending: float = 0.0  # iterserve:num_prompt_tokens_pending at the last scrape
    # this router's requests in flight there that no successful scrape has counted yet: id -> their
    # estimated prompt tokens (router/pods.py drops those a scrape covered, router/proxy.py finished ones)
    unscraped: dict[int, float] = field(default_factory=dict)
    ended: int = 0  # this router's requests the last scrape counted that have ended since

    def prefill_ahead(self) -> float:
        """Prompt tokens a new prompt would wait behind: the pod's at its last scrape, and this router's since."""
        return self.prompt_tokens_pending + sum(self.unscraped.values())

    def requests(self) -> float:
        """Requests on the pod: this router's in flight, or every client's at the last scrape (less this
        router's that have ended since) if more."""
        return max(self.in_flight, self.waiting + self.running - self.ended)

    def work_ahead(self, request_tokens: float = REQUEST_TOKENS) -> float:
        return self.prefill_ahead() + request_tokens * self.requests()


@dataclass(frozen=True)
class Decision:
    pod: str
    spilled: bool = False  # prefix-hash: the key's own pod was over the bound, a later one on the ring took it


class LeastLoad:
    def __init__(self, prefill: bool = True, request_tokens: float = REQUEST_TOKENS) -> None:
        self._turn = 0
        self.prefill = prefill  # False: `least-requests`
        self.request_tokens = request_tokens

    def pick(self, pods: Sequence[PodLoad], key: str | None = None) -> Decision:
        if not pods:
            raise LookupError("no pod to route to")
        self._turn += 1
        n = len(pods)
        # the rotating start index is the last tie-break: equally loaded pods take turns
        if self.prefill:
            best = min(range(n), key=lambda i: (pods[i].work_ahead(self.request_tokens), pods[i].kv_usage,
                                                (i - self._turn) % n))
        else:
            best = min(range(n), key=lambda i: (pods[i].requests(), pods[i].kv_usage, (i - self._turn) % n))
        return Decision(pods[best].name)


class RoundRobin:
    """Each pod in turn, blind to load: the baseline the other policies are measured against."""

    def __init__(self) -> None:
        self._turn = -1

    def pick(self, pods: Sequence[PodLoad], key: str | None = None) -> Decision:
        if not pods:
            raise LookupError("no pod to route to")
        self._turn += 1
        # by name, not by position: the healthy list's order is the discovery's, which may change
        ordered = sorted(p.name for p in pods)
        return Decision(ordered[self._turn % len(ordered)])


def _hash64(text: str) -> int:
    # blake2b is in the standard library, fast, and well mixed: neighbouring keys land far apart
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class HashRing:
    """A consistent-hash ring: each pod at `vnodes` points, so that keys spread evenly and a pod's removal
    hands its arcs to many others rather than to one neighbour."""

    def __init__(self, pods: Iterable[str], vnodes: int = 100) -> None:
        self.vnodes = vnodes
        self.pods = tuple(sorted(set(pods)))
        points = sorted((_hash64(f"{pod}#{i}"), pod) for pod in self.pods for i in range(vnodes))
        self._hashes = [h for h, _ in points]
        self._owners = [p for _, p in points]

    def walk(self, key: str):
        """The pods in ring order from `key`'s position, each once."""
        if not self._owners:
            return
        start = bisect.bisect(self._hashes, _hash64(key))
        seen = set()
        for i in range(len(self._owners)):
            pod = self._owners[(start + i) % len(self._owners)]
            if pod not in seen:
                seen.add(pod)
                yield pod
                if len(seen) == len(self.pods):
                    return


class PrefixHash:
    """CHWBL over the pods passed to each `pick` (the healthy ones): the ring holds every known pod, and
    the walk skips those absent, so a pod that fails and returns keeps its arcs."""

    def __init__(self, load_factor: float = 1.25, vnodes: int = 100) -> None:
        if load_factor < 1.0:
            raise ValueError(f"load_factor must be at least 1 (got {load_factor}): below 1 no pod could take "
                             "a request when all are equally loaded")
        self.load_factor = load_factor
        self.vnodes = vnodes
        self._ring = HashRing((), vnodes)
        self._fallback = LeastLoad()

    def pick(self, pods: Sequence[PodLoad], key: str | None = None) -> Decision:
        if not pods:
            raise LookupError("no pod to route to")
        if key is None:  # nothing to hash (e.g. /v1/models): the least loaded pod
            return self._fallback.pick(pods)
        by_name = {p.name: p for p in pods}
        if not set(by_name) <= set(self._ring.pods):
            self._ring = HashRing(set(self._ring.pods) | set(by_name), self.vnodes)
        total = sum(p.in_flight for p in pods)
        # the bound counts the request being placed; with load_factor >= 1 the least loaded pod is always
        # under it, so the walk always ends on a pod
        bound = math.ceil(self.load_factor * (total + 1) / len(pods))
        first = True
        for name in self._ring.walk(key):
            pod = by_name.get(name)
            if pod is None:
                continue
            if pod.in_flight + 1 <= bound:
                return Decision(name, spilled=not first)
            first = False
        raise AssertionError("unreachable: the least loaded pod is always under the bound")


def make_policy(name: str, load_factor: float = 1.25, request_tokens: float = REQUEST_TOKENS):
    if name == "least-load":
        return LeastLoad(request_tokens=request_tokens)
    if name == "least-requests":
        return LeastLoad(prefill=False)
    if name == "prefix-hash":
        return PrefixHash(load_factor)
    if name == "round-robin":
        return RoundRobin()
    raise ValueError(f"unknown routing policy {name!r} (choose from {', '.join(POLICIES)})")
