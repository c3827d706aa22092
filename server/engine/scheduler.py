"""Iteration-level scheduling: at every step, choose which requests compute how many tokens.

Order of one `schedule()` (Orca's iteration-level batching, vLLM v1's token accounting):
  1. running requests first, oldest first: each takes the tokens it still has to compute, at most what
     is left of the step's `max_num_batched_tokens` (a decode takes 1); when one cannot get a KV block,
     the newest running request is preempted (its blocks freed, back to the waiting queue to recompute
     later) until it can;
  2. waiting requests are admitted in (priority, arrival) order while running < `max_num_seqs`, their
     next chunk's blocks fit and budget remains. Nothing is admitted in a step that had to preempt.
Prompt tokens (a request with more than one token left to compute is prefilling: a prompt, or a
preempted request's recompute) share a second budget, `prefill_chunk_size` per step over all requests
(Sarathi-Serve's chunk). A decode's stall is what one step's prefill costs, so the knob bounds it only
as a sum: a per-request cap lets N prompts that arrive together stall decodes N times as long.
The `static` policy is the baseline without iteration-level batching: a batch of up to `max_num_seqs`
is chosen only once the previous one has fully drained, and no one else joins it meanwhile.
With prefix caching on, a request is admitted from its longest cached prefix (block_manager.py): its
computed count starts there, and only the rest counts against the step's budgets.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from iterserve.common.wire import Knobs
from iterserve.server.engine.block_manager import BlockManager
from iterserve.server.engine.knobs import LiveKnobs
from iterserve.server.engine.request import Request, RequestStatus
from iterserve.server.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from iterserve.server.engine.grammar_manager import GrammarBitmask

POLICIES = ("continuous", "static")


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step, as plain data: what the model runner needs and nothing more."""

    request_id: str
    new_token_ids: list[int]  # the tokens this step computes (their K/V are written to the cache)
    num_computed_tokens: int  # tokens already in the cache: the position of new_token_ids[0]
    block_table: list[int]  # the request's block ids (owned by the block manager; read-only here)
    # set when this step reaches the request's last known token, so the runner samples its next one
    sampling_params: SamplingParams | None
    # the request's tokens so far (prompt, then outputs; the Request's own list, read-only) and how many
    # are prompt: given only when it samples with logits processing (penalties, bias, min_tokens)
    token_ids: list[int] | None = None
    num_prompt_tokens: int = 0


@dataclass
class SchedulerOutput:
    """What one step computes: the contract between the scheduler and the model runner (data only,
    keyed by request id; the runner never sees a Request)."""

    # in the order their tokens are laid out in the flattened batch
    scheduled: list[ScheduledRequest]
    # sum of len(new_token_ids); never above the step's max_num_batched_tokens
    total_num_scheduled_tokens: int
    # the knobs this step was scheduled under
    knobs: Knobs
    # requests that left the engine (finished or aborted) since the last step: the runner drops any
    # state it keeps for them (a seeded request's generator)
    finished_request_ids: list[str] = field(default_factory=list)
    # requests preempted in this step; their blocks are already back in the pool
    preempted_request_ids: list[str] = field(default_factory=list)
    # the token masks of the sampling requests with a grammar (set by the engine core after scheduling)
    grammar_bitmask: GrammarBitmask | None = None

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, block_manager: BlockManager, knobs: LiveKnobs, policy: str = "continuous",
                 is_ready: Callable[[Request], bool] | None = None):
        """is_ready: whether a waiting request may be admitted yet (its grammar compiled); one that may not
        is passed over, not waited for."""
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        self.block_manager = block_manager
        self.knobs = knobs
        self.policy = policy
        self.is_ready = is_ready
        self.waiting: list[Request] = []  # sorted by Request.sort_key
        self.running: list[Request] = []  # in admission order; the newest is preempted first
        self.num_preemptions = 0
        # prefix cache lookups at first admissions, in tokens (vLLM's prefix_cache_queries / _hits);
        # re-admissions after preemption are not counted
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # Other threads hand requests and aborts over through these; only schedule() drains them.
        self._new_requests: deque[Request] = deque()
        self._abort_ids: deque[str] = deque()
        self._live: dict[str, Request] = {}  # every unfinished request, by id (engine thread only)
        self._static_batch: set[str] = set()  # static policy: the ids of the batch being served
        self._finished_ids: list[str] = []  # left the engine since the last schedule(): told to the runner
        self.aborted: list[Request] = []  # the requests the latest schedule() found aborted

    # -- called from any thread ------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self._new_requests.append(request)

    def abort_request(self, request_id: str) -> None:
        self._abort_ids.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self._new_requests or self._abort_ids)

    def unfinished_request_ids(self) -> list[str]:
        """Every request added and not finished, including those not drained from the inbox yet."""
        return [*self._live, *(r.request_id for r in list(self._new_requests))]

    def num_waiting_requests(self) -> int:
        """Waiting requests, including those added since the last step (for admission control)."""
        return len(self.waiting) + len(self._new_requests)

    # -- called by the engine loop ---------------------------------------------------------------
    # schedule() decides; the engine then runs the model and reports each sampled token to the request
    # (Request.append_token) and finished ones here (finish_request).

    def schedule(self) -> SchedulerOutput:
        """Choose this step's requests and token counts; each scheduled request's num_computed_tokens
        already counts this step's tokens when it returns (the runner computes them next)."""
        self.aborted = self._drain_inboxes()
        knobs = self.knobs.value
        budget = knobs.max_num_batched_tokens
        prefill_left = knobs.prefill_chunk_size
        bm = self.block_manager
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = _num_to_compute(req.num_tokens - req.num_computed_tokens, budget, prefill_left)
            if n == 0:  # a prompt in progress, and this step's prefill tokens are spent: it waits a step
                i += 1
                continue
            while not bm.can_allocate(req.request_id, req.num_computed_tokens + n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            else:
                budget -= n
                prefill_left -= _prefill_tokens(req, n)
                scheduled.append(self._schedule_tokens(req, n))
                i += 1

        if not preempted:
            self._admit(knobs, budget, prefill_left, scheduled)

        finished, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(
            scheduled=scheduled,
            total_num_scheduled_tokens=sum(len(s.new_token_ids) for s in scheduled),
            knobs=knobs,
            finished_request_ids=finished,
            preempted_request_ids=preempted,
        )

    def get(self, request_id: str) -> Request:
        """The unfinished request with this id (engine thread only)."""
        return self._live[request_id]

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """Retire a running request now: its blocks go back to the pool within this step."""
        assert status.is_finished
        request.status = status
        request.finished_time = time.monotonic()
        self.running.remove(request)
        self._forget(request)

    # -- internals -------------------------------------------------------------------------------

    def _schedule_tokens(self, req: Request, n: int, cached: list[int] | None = None) -> ScheduledRequest:
        """Give `req` blocks for its next `n` tokens (from its `cached` prefix blocks when it is being
        admitted) and count them as computed."""
        start = req.num_computed_tokens
        table = self.block_manager.allocate(req.request_id, start + n, req.token_ids, cached or ())
        req.num_computed_tokens = start + n
        samples = req.num_computed_tokens == req.num_tokens
        params = req.sampling_params if samples else None
        history = params is not None and params.processes_logits
        return ScheduledRequest(req.request_id, req.token_ids[start:start + n], start, table, params,
                                req.token_ids if history else None, req.num_prompt_tokens if history else 0)

    def _admit(self, knobs: Knobs, budget: int, prefill_left: int,
               scheduled: list[ScheduledRequest]) -> None:
        bm = self.block_manager
        if self.policy == "static" and not self.running and not self._static_batch:
            self._static_batch = {r.request_id for r in self.waiting[: knobs.max_num_seqs]}
        idx = 0
        while idx < len(self.waiting) and budget > 0 and len(self.running) < knobs.max_num_seqs:
            req = self.waiting[idx]
            if (self.policy == "static" and req.request_id not in self._static_batch) or (
                    self.is_ready is not None and not self.is_ready(req)):
                idx += 1
                continue
            cached = bm.find_cached_prefix(req.request_id, req.token_ids)
            num_cached = len(cached) * bm.block_size
            n = _num_to_compute(req.num_tokens - num_cached, budget, prefill_left)
            if n == 0:
                break  # the step's prefill tokens are spent; FCFS: nobody overtakes the head
            if not bm.can_allocate(req.request_id, num_cached + n, cached):
                break  # FCFS: nobody overtakes the head for lack of memory
            del self.waiting[idx]
            req.status = RequestStatus.RUNNING
            if req.scheduled_time is None:
                req.scheduled_time = time.monotonic()
            if req.num_cached_tokens is None:  # first admission: what the client is told was cached
                req.num_cached_tokens = num_cached
                if bm.enable_caching:
                    self.prefix_cache_queries += req.num_tokens
                    self.prefix_cache_hits += num_cached
            req.num_computed_tokens = num_cached
            self.running.append(req)
            budget -= n
            prefill_left -= _prefill_tokens(req, n)
            scheduled.append(self._schedule_tokens(req, n, cached))

    def _preempt(self, req: Request) -> None:
        self.block_manager.free(req.request_id)  # its full blocks stay cached: readmitted, it finds them
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0  # recompute prompt and output so far (beyond any cached prefix)
        req.num_preemptions += 1
        self.num_preemptions += 1
        bisect.insort(self.waiting, req, key=_sort_key)

    def _drain_inboxes(self) -> list[Request]:
        while self._new_requests:
            req = self._new_requests.popleft()
            self._live[req.request_id] = req
            bisect.insort(self.waiting, req, key=_sort_key)
        aborted = []
        while self._abort_ids:
            live = self._live.get(self._abort_ids.popleft())
            if live is None:
                continue  # already finished, or never known
            req = live
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            req.status = RequestStatus.FINISHED_ABORTED
            req.finished_time = time.monotonic()
            self._forget(req)
            aborted.append(req)
        return aborted

    def _forget(self, req: Request) -> None:
        self.block_manager.free(req.request_id)
        self._live.pop(req.request_id, None)
        self._static_batch.discard(req.request_id)
        self._finished_ids.append(req.request_id)


def _sort_key(req: Request) -> tuple[int, int]:
    return req.sort_key


def _num_to_compute(left: int, budget: int, prefill_left: int) -> int:
    """Tokens a request with `left` tokens to compute computes this step: within the step's token budget
    and, while it is prefilling (more than one token left), within what is left of its prefill tokens."""
    return min(left, budget) if left <= 1 else min(left, budget, prefill_left)


def _prefill_tokens(req: Request, n: int) -> int:
    """Of the `n` tokens just scheduled for `req`, those that count as prefill (all, unless a decode)."""
    return n if req.num_tokens - req.num_computed_tokens > 1 else 0
