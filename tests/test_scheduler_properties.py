"""Property tests of the scheduler and the KV block bookkeeping, prefix caching included, driven through
LLMEngine.step() with the KVTraceRunner (no model: each next token is a function of the prefix read back
from an emulated paged KV cache, so a block shared or found wrongly makes a wrong token).

A hypothesis state machine adds requests, aborts them, changes the live knobs and steps the engine,
checking after every step the invariants listed in EngineMachine._check_schedule / _check_state; its
teardown drains the engine and checks every request's outcome. Separate tests force preemption
deterministically and check that the tokens a request gets do not depend on the knobs or the policy.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule

from iterserve.server.engine.knobs import SchedulerKnobs
from iterserve.server.engine.llm_engine import LLMEngine
from iterserve.server.engine.request import RequestStatus
from iterserve.server.engine.sampling_params import SamplingParams
from iterserve.server.errors import InvalidRequestError
from tests.kv_trace_runner import VOCAB, KVTraceRunner
from tests.kv_trace_runner import next_token as _trace_next_token

KNOB_NAMES = tuple(f.name for f in dataclasses.fields(SchedulerKnobs))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_token(tokens: list[int]) -> int:
    """The KVTraceRunner's next token after `tokens` (prompt + output so far)."""
    return _trace_next_token(tokens)


def reference_output(prompt: list[int], max_tokens: int, max_model_len: int) -> list[int]:
    tokens = list(prompt)
    out: list[int] = []
    while True:
        t = next_token(tokens)
        tokens.append(t)
        out.append(t)
        if len(out) >= max_tokens or len(tokens) >= max_model_len:
            return out


def make_engine(*, policy: str, block_size: int, num_blocks: int, max_model_len: int, knobs: SchedulerKnobs,
                prepare_inputs: bool = True, enable_prefix_caching: bool = True) -> LLMEngine:
    return LLMEngine(
        KVTraceRunner(block_size=block_size, vocab_size=VOCAB, prepare_inputs=prepare_inputs),
        tokenizer=None, max_model_len=max_model_len, num_blocks=num_blocks, block_size=block_size,
        knobs=knobs, policy=policy, eos_token_ids=(), vocab_size=VOCAB, enable_prefix_caching=enable_prefix_caching,
    )


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def make_prompt(length: int, seed: int) -> list[int]:
    return [(seed + 7 * i * i + 3 * i) % VOCAB for i in range(length)]


@dataclasses.dataclass
class Tracked:
    """The test's own model of one request."""

    rid: str
    prompt: list[int]
    max_tokens: int
    priority: int
    outputs: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    abort_requested: bool = False  # aborted while still unfinished (from the test's point of view)
    num_finished_outputs: int = 0
    num_cached: int | None = None  # prompt tokens found cached at its first admission

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class Captured:
    """What the wrapped Scheduler.schedule() saw and returned, recorded before the step runs."""

    out: object  # the SchedulerOutput: data only, keyed by request id
    pre_running: list  # running requests before schedule(), aborts not yet drained
    pre_new: list  # requests still in the inbox before schedule()
    pre_waiting: list
    scheduled: list  # the Request behind each of out.scheduled
    num_scheduled: list[int]  # tokens each scheduled request computes this step
    computed_before: list[int]  # num_computed_tokens of each scheduled request, before the step
    num_tokens_before: list[int]
    table_lens: list[int]
    tables_are_the_block_managers: bool  # each ScheduledRequest.block_table as the block manager holds it
    aborted: list  # the requests schedule() found aborted
    preempted: list  # the requests schedule() preempted
    running_after: list
    waiting_after: list


# ---------------------------------------------------------------------------------------------------
# the state machine
# ---------------------------------------------------------------------------------------------------


class EngineMachine(RuleBasedStateMachine):
    POLICY: str = ""  # "continuous" or "static": set by the concrete subclasses below
    CACHING: bool = True  # prefix caching on

    def __init__(self):
        super().__init__()
        self.eng = None
        self._ok = True  # False while a rule is running; teardown drains only after clean runs

    # -- setup ------------------------------------------------------------------------------------

    @initialize(
        block_size=st.integers(1, 8),
        max_model_len=st.integers(2, 32),
        # a tight pool (preemptions, evictions) or room for cached prefixes to be found again
        extra_blocks=st.integers(0, 3) | st.integers(8, 24),
        max_num_seqs=st.integers(1, 6),
        budget=st.integers(1, 40),
        chunk=st.integers(1, 16),
    )
    def setup(self, block_size, max_model_len, extra_blocks, max_num_seqs, budget, chunk):
        self.policy = self.POLICY
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.num_blocks = cdiv(max_model_len, block_size) + extra_blocks  # engine needs >= max_model_len slots
        self.knobs = SchedulerKnobs(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                    prefill_chunk_size=chunk)
        self.eng = make_engine(policy=self.policy, block_size=block_size, num_blocks=self.num_blocks,
                               max_model_len=max_model_len, knobs=self.knobs, enable_prefix_caching=self.CACHING)
        self.num_resets = 0
        self.num_shared_seen = 0
        self.reqs: dict[str, Tracked] = {}
        self.pending_aborts: set[str] = set()  # unfinished requests aborted since the last step
        self.num_preempted_seen = 0
        self.static_batch: set[str] = set()
        self.next_id = 0
        self.num_steps = 0
        self.num_tokens_scheduled = 0
        self._captured: Captured | None = None

        sched = self.eng.scheduler
        original = sched.schedule

        def schedule():
            pre_running = list(sched.running)
            pre_new = list(sched._new_requests)
            pre_waiting = list(sched.waiting)
            out = original()
            running_before = {r.request_id: r for r in pre_running}
            self._captured = Captured(
                out=out, pre_running=pre_running, pre_new=pre_new, pre_waiting=pre_waiting,
                scheduled=[sched.get(s.request_id) for s in out.scheduled],
                num_scheduled=[len(s.new_token_ids) for s in out.scheduled],
                computed_before=[s.num_computed_tokens for s in out.scheduled],
                num_tokens_before=[sched.get(s.request_id).num_tokens for s in out.scheduled],
                table_lens=[len(s.block_table) for s in out.scheduled],
                tables_are_the_block_managers=all(
                    s.block_table == self.eng.block_manager.block_tables.get(s.request_id) for s in out.scheduled),
                aborted=list(sched.aborted),
                preempted=[running_before[rid] for rid in out.preempted_request_ids],
                running_after=list(sched.running), waiting_after=list(sched.waiting),
            )
            return out

        sched.schedule = schedule

    # -- rules ------------------------------------------------------------------------------------

    @rule(data=st.data(), max_tokens=st.integers(1, 24), priority=st.integers(-2, 2), seed=st.integers(0, VOCAB))
    def add_request(self, data, max_tokens, priority, seed):
        self._ok = False
        length = data.draw(st.integers(1, self.max_model_len - 1), label="prompt_len")
        self._add(length, max_tokens, priority, seed)
        self._ok = True

    @rule(data=st.data(), count=st.integers(2, 4))
    def add_burst(self, data, count):
        self._ok = False
        for _ in range(count):
            length = data.draw(st.integers(1, self.max_model_len - 1), label="prompt_len")
            max_tokens = data.draw(st.integers(1, 24), label="max_tokens")
            priority = data.draw(st.integers(-2, 2), label="priority")
            self._add(length, max_tokens, priority, seed=self.next_id * 13)
        self._ok = True

    @rule(data=st.data(), max_tokens=st.integers(1, 24), priority=st.integers(-2, 2), seed=st.integers(0, VOCAB),
          copies=st.integers(1, 3))
    def add_sharing_request(self, data, max_tokens, priority, seed, copies):
        """Prompts that begin with some earlier request's tokens (its prompt and output so far), cut
        anywhere: inside a block, on a block boundary, or not at all (the same prompt again); `copies`
        of them at once, so they share blocks while running."""
        self._ok = False
        if self.reqs:
            rid = data.draw(st.sampled_from(sorted(self.reqs)), label="shares_with")
            tokens = (self.reqs[rid].prompt + self.reqs[rid].outputs)[: self.max_model_len - 1]
            shared = data.draw(st.integers(1, len(tokens)), label="shared_len")
            for _ in range(copies):
                length = data.draw(st.integers(shared, self.max_model_len - 1), label="prompt_len")
                self._add(length, max_tokens, priority, seed, tokens[:shared])
        self._ok = True

    @rule()
    def reset_prefix_cache(self):
        self._ok = False
        before = self.eng.block_manager.pool.num_cached
        assert self.eng.reset_prefix_cache() == before
        assert self.eng.block_manager.pool.num_cached == self.eng.block_manager.num_cached_free_blocks == 0
        self.num_resets += 1
        self._ok = True

    def _add(self, length: int, max_tokens: int, priority: int, seed: int, head: list[int] = ()) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        prompt = list(head) + make_prompt(length - len(head), seed)
        got = self.eng.add_request(prompt_token_ids=prompt, sampling_params=params(max_tokens),
                                   request_id=rid, priority=priority)
        assert got == rid
        self.reqs[rid] = Tracked(rid, prompt, max_tokens, priority)

    @rule(extra=st.integers(0, 3))
    def add_too_long_request(self, extra):
        self._ok = False
        before = len(self.eng.scheduler._new_requests)
        with pytest.raises(InvalidRequestError):
            self.eng.add_request(prompt_token_ids=[1] * (self.max_model_len + extra), sampling_params=params(1),
                                 request_id="too-long")
        assert len(self.eng.scheduler._new_requests) == before
        self._ok = True

    @rule(data=st.data())
    def abort_known(self, data):
        self._ok = False
        if not self.reqs:
            self._ok = True
            return
        rid = data.draw(st.sampled_from(sorted(self.reqs)), label="rid")
        tr = self.reqs[rid]
        self.eng.abort_request(rid)
        if not tr.finished:
            tr.abort_requested = True
            self.pending_aborts.add(rid)
        self._ok = True

    @rule()
    def abort_unknown(self):
        self._ok = False
        self.eng.abort_request("never-added")
        self._ok = True

    @rule(max_num_seqs=st.none() | st.integers(1, 6), budget=st.none() | st.integers(1, 40),
          chunk=st.none() | st.integers(1, 16))
    def change_knobs(self, max_num_seqs, budget, chunk):
        self._ok = False
        changes = {}
        if max_num_seqs is not None:
            changes["max_num_seqs"] = max_num_seqs
        if budget is not None:
            changes["max_num_batched_tokens"] = budget
        if chunk is not None:
            changes["prefill_chunk_size"] = chunk
        new = self.eng.update_knobs(**changes)
        self.knobs = dataclasses.replace(self.knobs, **changes)
        assert new == self.knobs == self.eng.knobs.value
        self._ok = True

    @rule(name=st.sampled_from(KNOB_NAMES), bad=st.sampled_from([0, -1, -100, True, False, 2.0, "4", None]),
          also_valid=st.booleans())
    def change_knobs_invalid(self, name, bad, also_valid):
        self._ok = False
        before = self.eng.knobs.value
        num_changes = self.eng.knobs.num_changes
        changes = {name: bad}
        if also_valid:  # a valid change in the same call must not be applied either
            other = next(n for n in KNOB_NAMES if n != name)
            changes[other] = getattr(before, other) % 5 + 1
        with pytest.raises(InvalidRequestError):
            self.eng.update_knobs(**changes)
        with pytest.raises(InvalidRequestError):
            self.eng.update_knobs(max_num_seq=3)  # unknown knob
        assert self.eng.knobs.value is before
        assert self.eng.knobs.num_changes == num_changes
        self._ok = True

    @rule()
    def step(self):
        self._ok = False
        self._step_and_check()
        self._ok = True

    @rule()
    def step_several(self):
        self._ok = False
        for _ in range(5):
            self._step_and_check()
        self._ok = True

    # -- the final phase --------------------------------------------------------------------------

    def teardown(self):
        if self.eng is None or not self._ok:
            return  # a rule failed: report that failure, not a consequence of it
        live_work = sum(len(t.prompt) + t.max_tokens for t in self.reqs.values() if not t.finished)
        bound = 200 + 50 * live_work
        steps = 0
        while self.eng.has_unfinished_requests():
            assert steps < bound, f"the engine did not drain in {bound} steps: {self._describe()}"
            self._step_and_check()
            steps += 1
        sched, bm = self.eng.scheduler, self.eng.block_manager
        assert not sched.running and not sched.waiting and not sched._live
        assert bm.num_free_blocks == bm.num_blocks and bm.block_tables == {} and bm.usage == 0.0
        assert all(count == 0 for count in bm.pool.ref_counts)
        if not self.CACHING:
            assert bm.pool.num_cached == 0 and eng_hits(self.eng) == (0, 0)
        assert not self.pending_aborts
        for tr in self.reqs.values():
            assert tr.finished, tr
            assert tr.num_finished_outputs == 1, tr
            if tr.abort_requested:
                assert tr.finish_reason == "abort", tr
                assert len(tr.outputs) < tr.max_tokens and len(tr.prompt) + len(tr.outputs) < self.max_model_len
            else:
                assert tr.finish_reason == "length", tr
                assert tr.outputs == reference_output(tr.prompt, tr.max_tokens, self.max_model_len), tr
            assert tr.outputs == reference_output(tr.prompt, tr.max_tokens, self.max_model_len)[: len(tr.outputs)]
        if self.num_preempted_seen:
            event("preemptions happened")
        if eng_hits(self.eng)[1]:
            event("prefix cache hits happened")
        if self.num_shared_seen:
            event("running requests shared a block")
        if any(t.abort_requested for t in self.reqs.values()):
            event("aborts happened")

    # -- checks -----------------------------------------------------------------------------------

    def _describe(self) -> str:
        s = self.eng.scheduler
        return (f"running={s.running} waiting={s.waiting} knobs={self.knobs} "
                f"tables={self.eng.block_manager.block_tables}")

    def _step_and_check(self):
        eng = self.eng
        sched = eng.scheduler
        running_before = list(sched.running)
        self._captured = None
        # static policy: will schedule() form a new batch? (replicates the documented rule: only once
        # the previous batch has fully drained, from the first max_num_seqs waiting requests)
        drained_waiting = sorted(
            [r for r in list(sched.waiting) + list(sched._new_requests) if r.request_id not in self.pending_aborts],
            key=lambda r: r.sort_key,
        )
        drained_running = [r for r in running_before if r.request_id not in self.pending_aborts]
        unfinished_members = {rid for rid in self.static_batch if not self.reqs[rid].finished
                              and rid not in self.pending_aborts}
        if self.policy == "static" and not drained_running and not unfinished_members:
            self.static_batch = {r.request_id for r in drained_waiting[: self.knobs.max_num_seqs]}

        outputs = eng.step()
        cap = self._captured
        assert cap is not None, "step() did not call scheduler.schedule()"
        self.num_steps += 1
        self.num_tokens_scheduled += cap.out.total_num_scheduled_tokens
        self._check_schedule(cap, drained_running, drained_waiting)
        self._check_outputs(cap, outputs)
        self._check_state(cap)

    def _check_schedule(self, cap: Captured, drained_running, drained_waiting):
        out = cap.out
        knobs = out.knobs
        bs = self.block_size
        bm = self.eng.block_manager
        assert knobs == self.knobs, "the step must run under the knobs in force"
        n_sched = len(out.scheduled)
        ids = [s.request_id for s in out.scheduled]
        assert len(set(ids)) == n_sched, f"a request is scheduled twice: {ids}"
        # token budget and chunking
        assert out.total_num_scheduled_tokens == sum(cap.num_scheduled)
        assert out.total_num_scheduled_tokens <= knobs.max_num_batched_tokens
        for s, req, n, c, total, tlen in zip(out.scheduled, cap.scheduled, cap.num_scheduled, cap.computed_before,
                                             cap.num_tokens_before, cap.table_lens):
            assert 1 <= n, (req, n, knobs)
            tr = self.reqs[req.request_id]
            if tr.num_cached is None:  # its first admission: from a cached prefix of whole blocks
                tr.num_cached = c
                assert c % bs == 0 and c < total and (self.CACHING or c == 0), (req, c)
            assert c + n <= total, f"{req} scheduled {n} tokens past its end"
            # the runner's contract: the tokens to compute, from where, and whether to sample after them
            assert s.new_token_ids == req.token_ids[c : c + n], (s, req)
            assert (s.sampling_params is not None) == (c + n == total), (s, req)
            # on-demand allocation: exactly the blocks this step's tokens need
            assert tlen == cdiv(c + n, bs), (req, c, n, tlen)
        assert cap.tables_are_the_block_managers
        # prefill tokens (requests with more than one token left) share prefill_chunk_size per step
        prefill = [n for n, c, total in zip(cap.num_scheduled, cap.computed_before, cap.num_tokens_before)
                   if total - c > 1]
        assert sum(prefill) <= knobs.prefill_chunk_size, (prefill, knobs)
        # aborts: exactly the unfinished requests aborted since the last step
        aborted_ids = {r.request_id for r in cap.aborted}
        assert len(aborted_ids) == len(cap.aborted), "a request is aborted twice"
        assert aborted_ids == self.pending_aborts, (aborted_ids, self.pending_aborts)
        assert aborted_ids <= set(out.finished_request_ids), "the runner must hear of every request that left"
        for r in cap.aborted:
            assert r.status == RequestStatus.FINISHED_ABORTED
            assert r.request_id not in bm.block_tables
            assert r not in cap.running_after and r not in cap.waiting_after
        # preemption: newest first, and nothing is admitted in a step that preempts
        pre_ids = {r.request_id for r in drained_running}
        admitted = [r for r in cap.scheduled if r.request_id not in pre_ids]
        preempted = cap.preempted
        assert [r.request_id for r in drained_running] == (
            [r.request_id for r in cap.running_after if r.request_id in pre_ids]
            + [r.request_id for r in reversed(preempted)]
        ), "preempted requests must be the newest running ones, newest first"
        for r in preempted:
            assert r.status == RequestStatus.PREEMPTED and r.num_computed_tokens == 0
            assert r.request_id not in bm.block_tables or not bm.block_tables[r.request_id]
            assert r in cap.waiting_after
        if preempted:
            assert not admitted, f"admitted {admitted} in a step that preempted {preempted}"
            self.num_preempted_seen += len(preempted)
        # running requests come first, then admitted ones, in (priority, arrival) order
        assert cap.scheduled[n_sched - len(admitted):] == admitted
        keys = [r.sort_key for r in admitted]
        assert keys == sorted(keys)
        assert cap.running_after == [r for r in drained_running if r not in preempted] + admitted
        # max_num_seqs: lowering it evicts nobody, but nothing is admitted while at or above it
        if admitted:
            assert len(cap.running_after) <= knobs.max_num_seqs, (len(cap.running_after), knobs)
        assert len(cap.running_after) <= max(knobs.max_num_seqs, len(drained_running))
        # admission order: nobody still waiting was due before an admitted request
        if self.policy == "continuous" and admitted:
            still_waiting = [r.sort_key for r in cap.waiting_after]
            assert not still_waiting or max(keys) < min(still_waiting), "a waiting request was overtaken"
        if self.policy == "static":
            members = self.static_batch
            for r in admitted:
                assert r.request_id in members, (
                    f"static policy: {r.request_id} joined the batch {sorted(members)} before it drained"
                )
            for r in cap.running_after:
                assert r.request_id in members, (r, sorted(members))
            if admitted:
                waiting_members = [r.sort_key for r in cap.waiting_after if r.request_id in members]
                assert not waiting_members or max(keys) < min(waiting_members)

    def _check_outputs(self, cap: Captured, outputs):
        # every scheduled request whose computed tokens reach its end samples exactly one token
        sampling = {r.request_id for r, n, c, total in zip(cap.scheduled, cap.num_scheduled,
                                                           cap.computed_before, cap.num_tokens_before)
                    if c + n == total}
        seen = [o.request_id for o in outputs]
        assert len(seen) == len(set(seen)), f"two outputs for one request in a step: {seen}"
        assert set(seen) == sampling | self.pending_aborts, (seen, sampling, self.pending_aborts)
        for o in outputs:
            tr = self.reqs[o.request_id]
            assert not tr.finished, f"output after the finished one: {o}"
            assert o.prompt_token_ids == tr.prompt
            if o.request_id in self.pending_aborts:
                assert o.finished and o.finish_reason == "abort" and o.new_token_ids == [], o
            else:
                assert len(o.new_token_ids) == 1, o
                assert o.num_cached_tokens == tr.num_cached, (o, tr)
                expected = next_token(tr.prompt + tr.outputs)
                assert o.new_token_ids == [expected], f"{o.request_id}: got {o.new_token_ids}, expected {expected}"
            tr.outputs = tr.outputs + list(o.new_token_ids)
            # token_ids: every output token on the final output; empty while the request runs
            assert o.token_ids == (tr.outputs if o.finished else []), (o, tr)
            n_out = len(tr.outputs)
            at_length = n_out >= tr.max_tokens or len(tr.prompt) + n_out >= self.max_model_len
            if o.finish_reason != "abort":
                assert n_out <= tr.max_tokens and len(tr.prompt) + n_out <= self.max_model_len
                assert o.finished == at_length, (o, tr)
                assert o.finish_reason == ("length" if at_length else None)
            if o.finished:
                tr.finish_reason = o.finish_reason
                tr.num_finished_outputs += 1
        self.pending_aborts.clear()

    def _check_state(self, cap: Captured):
        eng = self.eng
        sched, bm = eng.scheduler, eng.block_manager
        bs = self.block_size
        # a block's reference count is the number of tables holding it (never negative); a block is
        # either held or free, never both; owned + free == total
        owned = [b for t in bm.block_tables.values() for b in t]
        free = bm.free_block_ids()
        counts = bm.pool.ref_counts
        self.num_shared_seen += any(c > 1 for c in counts)
        assert all(counts[b] == owned.count(b) for b in range(bm.num_blocks)), (bm.block_tables, counts)
        assert len(free) == len(set(free)), "a block is free twice"
        assert not set(free) & set(owned), f"a block is both free and referenced: {bm.block_tables} {free}"
        assert sorted(set(owned) | set(free)) == list(range(bm.num_blocks)), (bm.block_tables, free)
        assert bm.num_used_blocks == len(set(owned))
        # a block held by several requests is a full one of each (only full blocks are shared, never written)
        for r in sched.running:
            for i, b in enumerate(bm.block_tables[r.request_id]):
                assert counts[b] == 1 or (i + 1) * bs <= r.num_computed_tokens, (r, i, b, counts[b])
        if not self.CACHING:
            assert bm.pool.num_cached == 0
        # every computed position holds its request's own prefix; every cached block its hash's prefix
        eng.model_runner.check_cache(bm, sched.running)
        first_admitted = [t for t in self.reqs.values() if t.num_cached is not None]
        if self.CACHING:
            assert eng_hits(eng) == (sum(len(t.prompt) for t in first_admitted),
                                     sum(t.num_cached for t in first_admitted))
        # only running requests own blocks, exactly ceil(num_computed_tokens / block_size) of them
        running_ids = [r.request_id for r in sched.running]
        assert len(running_ids) == len(set(running_ids))
        assert {k for k, t in bm.block_tables.items() if t} == set(running_ids), (bm.block_tables, running_ids)
        for r in sched.running:
            assert r.status == RequestStatus.RUNNING
            assert 1 <= r.num_computed_tokens <= r.num_tokens <= self.max_model_len, r
            assert len(bm.block_tables[r.request_id]) == cdiv(r.num_computed_tokens, bs), (
                r, bm.block_tables[r.request_id])
        assert len(sched.running) <= max(self.knobs.max_num_seqs, len(cap.pre_running))
        waiting_ids = [r.request_id for r in sched.waiting]
        assert len(waiting_ids) == len(set(waiting_ids)) and not set(waiting_ids) & set(running_ids)
        assert [r.sort_key for r in sched.waiting] == sorted(r.sort_key for r in sched.waiting)
        for r in sched.waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), r
            assert r.num_computed_tokens == 0, r
            assert r.num_tokens < self.max_model_len
        # the test's model agrees with the scheduler about who is unfinished
        unfinished = {rid for rid, t in self.reqs.items() if not t.finished}
        assert unfinished == set(running_ids) | set(waiting_ids), (unfinished, running_ids, waiting_ids)
        assert set(sched._live) == unfinished
        for rid, t in self.reqs.items():
            if t.finished:
                assert rid not in bm.block_tables
        assert eng.has_unfinished_requests() == bool(unfinished)
        # a request never holds more than one partly filled block
        empty = sum(len(bm.block_tables[r.request_id]) * bs - r.num_computed_tokens for r in sched.running)
        assert 0 <= empty <= (bs - 1) * len(sched.running)
        stats = eng.stats
        assert stats.num_preemptions == sched.num_preemptions == self.num_preempted_seen
        assert stats.num_steps == self.num_steps
        assert stats.num_generated_tokens == sum(len(t.outputs) for t in self.reqs.values())
        assert stats.num_generated_tokens + stats.num_prompt_tokens_computed == self.num_tokens_scheduled
        assert stats.filled_slot_steps <= stats.allocated_slot_steps and 0.0 <= stats.kv_waste <= 1.0


MACHINE_SETTINGS = settings(
    max_examples=100,
    stateful_step_count=50,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
)


class ContinuousMachine(EngineMachine):
    POLICY = "continuous"


class StaticMachine(EngineMachine):
    POLICY = "static"


class ContinuousNoCacheMachine(EngineMachine):
    POLICY = "continuous"
    CACHING = False


def eng_hits(eng) -> tuple[int, int]:
    return eng.stats.prefix_cache_queries, eng.stats.prefix_cache_hits


TestContinuousPolicy = ContinuousMachine.TestCase
TestContinuousPolicy.settings = MACHINE_SETTINGS
TestStaticPolicy = StaticMachine.TestCase
TestStaticPolicy.settings = MACHINE_SETTINGS
TestContinuousPolicyWithoutPrefixCaching = ContinuousNoCacheMachine.TestCase
TestContinuousPolicyWithoutPrefixCaching.settings = MACHINE_SETTINGS


# ---------------------------------------------------------------------------------------------------
# deterministic tests
# ---------------------------------------------------------------------------------------------------


def run_to_completion(eng: LLMEngine, max_steps: int = 10_000) -> dict[str, list]:
    finals: dict[str, list] = {}
    streamed: dict[str, list[int]] = {}
    steps = 0
    while eng.has_unfinished_requests():
        assert steps < max_steps, "the engine did not drain"
        for o in eng.step():
            assert o.request_id not in finals, f"output after the finished one: {o}"
            streamed.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                assert o.token_ids == streamed[o.request_id], o
                finals[o.request_id] = [o.token_ids, o.finish_reason]
        steps += 1
    return finals


@pytest.mark.parametrize("policy", ["continuous", "static"])
@pytest.mark.parametrize("prepare_inputs", [True, False])
def test_tiny_pool_forces_preemption_and_everything_completes(policy, prepare_inputs):
    # 4 blocks of 2 slots hold one request of max_model_len 8; three requests of 3 prompt tokens and 5
    # output tokens each end at 8 tokens (4 blocks), so the pool cannot hold even two of them.
    eng = make_engine(policy=policy, block_size=2, num_blocks=4, max_model_len=8,
                      knobs=SchedulerKnobs(max_num_seqs=3, max_num_batched_tokens=16, prefill_chunk_size=4),
                      prepare_inputs=prepare_inputs)
    prompts = {f"p{i}": make_prompt(3, 10 * i) for i in range(3)}
    for rid, prompt in prompts.items():
        eng.add_request(prompt_token_ids=prompt, sampling_params=params(5), request_id=rid)
    finals = run_to_completion(eng)
    assert eng.stats.num_preemptions > 0
    assert set(finals) == set(prompts)
    for rid, prompt in prompts.items():
        tokens, reason = finals[rid]
        assert reason == "length"
        assert len(tokens) == 5
        assert tokens == reference_output(prompt, 5, 8)
    assert eng.block_manager.num_free_blocks == 4


def test_preempted_request_recomputes_and_keeps_its_output():
    # block_size 1, 8 blocks: two requests of 2 prompt tokens and 5 output tokens (7 tokens in the
    # end, 6 computed) cannot both fit; the newer one is preempted and recomputes prompt + output.
    eng = make_engine(policy="continuous", block_size=1, num_blocks=8, max_model_len=8,
                      knobs=SchedulerKnobs(max_num_seqs=2, max_num_batched_tokens=8, prefill_chunk_size=8))
    eng.add_request(prompt_token_ids=[5, 6], sampling_params=params(5), request_id="old")
    eng.add_request(prompt_token_ids=[7, 8], sampling_params=params(5), request_id="new")
    finals = run_to_completion(eng)
    assert eng.stats.num_preemptions > 0
    assert finals["old"] == [reference_output([5, 6], 5, 8), "length"]
    assert finals["new"] == [reference_output([7, 8], 5, 8), "length"]


def test_engine_refuses_a_pool_smaller_than_max_model_len():
    with pytest.raises(InvalidRequestError):
        make_engine(policy="continuous", block_size=4, num_blocks=3, max_model_len=13,
                    knobs=SchedulerKnobs())
    make_engine(policy="continuous", block_size=4, num_blocks=4, max_model_len=16, knobs=SchedulerKnobs())


def test_abort_of_finished_or_unknown_request_yields_nothing():
    eng = make_engine(policy="continuous", block_size=4, num_blocks=8, max_model_len=16,
                      knobs=SchedulerKnobs(max_num_seqs=2, max_num_batched_tokens=16, prefill_chunk_size=8))
    eng.add_request(prompt_token_ids=[1, 2], sampling_params=params(1), request_id="a")
    assert [o.finished for o in eng.step()] == [True]
    eng.abort_request("a")
    eng.abort_request("nobody")
    assert eng.step() == []
    assert not eng.has_unfinished_requests()
    eng.add_request(prompt_token_ids=[1, 2], sampling_params=params(3), request_id="b")
    eng.abort_request("b")
    eng.abort_request("b")
    outs = eng.step()
    assert [(o.request_id, o.finished, o.finish_reason, o.token_ids) for o in outs] == [("b", True, "abort", [])]
    assert eng.step() == []
    assert eng.block_manager.num_free_blocks == 8


# ---------------------------------------------------------------------------------------------------
# the tokens a request gets do not depend on the knobs, the block size or the policy
# ---------------------------------------------------------------------------------------------------

MAX_MODEL_LEN = 24

engine_configs = st.fixed_dictionaries({
    "policy": st.sampled_from(("continuous", "static")),
    "caching": st.booleans(),
    "block_size": st.integers(1, 8),
    "extra_blocks": st.integers(0, 6),
    "knobs": st.builds(SchedulerKnobs, max_num_seqs=st.integers(1, 6), max_num_batched_tokens=st.integers(1, 48),
                       prefill_chunk_size=st.integers(1, 24)),
    # a live knob change at some step (None: none)
    "change_at": st.none() | st.integers(0, 30),
    "new_knobs": st.builds(SchedulerKnobs, max_num_seqs=st.integers(1, 6),
                           max_num_batched_tokens=st.integers(1, 48), prefill_chunk_size=st.integers(1, 24)),
})

request_sets = st.lists(
    st.tuples(
        st.integers(1, MAX_MODEL_LEN - 1),  # prompt length
        st.integers(1, 16),  # max_tokens
        st.integers(-1, 1),  # priority
        st.integers(0, 6),  # the step before which it arrives
        st.integers(0, VOCAB - 1),  # prompt seed
    ),
    min_size=1, max_size=8,
)


def run_config(config: dict, requests) -> tuple[dict[str, list[int]], int]:
    bs = config["block_size"]
    eng = make_engine(policy=config["policy"], block_size=bs,
                      num_blocks=cdiv(MAX_MODEL_LEN, bs) + config["extra_blocks"], max_model_len=MAX_MODEL_LEN,
                      knobs=config["knobs"], enable_prefix_caching=config["caching"])
    finals: dict[str, list[int]] = {}
    streamed: dict[str, list[int]] = {}
    pending = sorted(enumerate(requests), key=lambda x: x[1][3])
    step = 0
    while pending or eng.has_unfinished_requests():
        assert step < 20_000, "the engine did not drain"
        while pending and pending[0][1][3] <= step:
            i, (length, max_tokens, priority, _, seed) = pending.pop(0)
            eng.add_request(prompt_token_ids=make_prompt(length, seed), sampling_params=params(max_tokens),
                            request_id=f"q{i}", priority=priority)
        if config["change_at"] == step:
            eng.update_knobs(**config["new_knobs"].as_dict())
        for o in eng.step():
            assert o.request_id not in finals
            streamed.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                assert o.finish_reason == "length"
                assert o.token_ids == streamed[o.request_id], o
                finals[o.request_id] = o.token_ids
        step += 1
    return finals, eng.stats.num_preemptions


@settings(max_examples=60, deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
@given(requests=request_sets, configs=st.lists(engine_configs, min_size=2, max_size=3))
def test_tokens_do_not_depend_on_knobs(requests, configs):
    expected = {
        f"q{i}": reference_output(make_prompt(length, seed), max_tokens, MAX_MODEL_LEN)
        for i, (length, max_tokens, _, _, seed) in enumerate(requests)
    }
    results = []
    for config in configs:
        finals, num_preemptions = run_config(config, requests)
        if num_preemptions:
            event("preemptions happened")
        results.append(finals)
        assert finals == expected, config
    assert all(r == results[0] for r in results)


# ---------------------------------------------------------------------------------------------------
# request ids
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("steps_before", [0, 1])
def test_duplicate_live_request_id_is_rejected(steps_before):
    # The block manager, the scheduler's live set and the output processor are all keyed by request id,
    # so a second live request under the same id would share the first one's KV blocks.
    eng = make_engine(policy="continuous", block_size=2, num_blocks=8, max_model_len=16,
                      knobs=SchedulerKnobs(max_num_seqs=4, max_num_batched_tokens=16, prefill_chunk_size=8))
    eng.add_request(prompt_token_ids=[1, 2, 3], sampling_params=params(4), request_id="x")
    outputs = [o for _ in range(steps_before) for o in eng.step()]
    with pytest.raises(InvalidRequestError) as e:
        eng.add_request(prompt_token_ids=[4, 5, 6, 7, 8], sampling_params=params(4), request_id="x")
    assert e.value.param == "request_id"
    while eng.has_unfinished_requests():
        outputs += eng.step()
    assert [(o.request_id, o.finish_reason) for o in outputs if o.finished] == [("x", "length")]
    assert outputs[-1].token_ids == reference_output([1, 2, 3], 4, 16)
    assert eng.block_manager.num_free_blocks == 8


def test_request_id_can_be_reused_once_finished():
    eng = make_engine(policy="continuous", block_size=2, num_blocks=8, max_model_len=16,
                      knobs=SchedulerKnobs(max_num_seqs=4, max_num_batched_tokens=16, prefill_chunk_size=8))
    for prompt in ([1, 2, 3], [4, 5, 6, 7, 8]):
        eng.add_request(prompt_token_ids=prompt, sampling_params=params(4), request_id="x")
        assert run_to_completion(eng, max_steps=100) == {"x": [reference_output(prompt, 4, 16), "length"]}
    assert eng.block_manager.num_free_blocks == 8
