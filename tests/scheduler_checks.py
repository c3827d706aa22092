"""The checks the scheduler's state machine (tests/test_scheduler_properties.py) makes after every step:
what was scheduled (budgets, chunking, allocation, preemption, admission order), what came out, and
the engine's state (block bookkeeping, prefix cache, statistics)."""

from __future__ import annotations

from iterserve.server.engine.request import RequestStatus
from tests.scheduler_support import Captured, cdiv, eng_hits, next_token


class ScheduleChecks:
    """Mixed into EngineMachine: reads its records (self.reqs, self.knobs, ...) and the engine."""


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
                                             cap.num_tokens_before, cap.table_lens, strict=True):
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
        prefill = [n for n, c, total in zip(cap.num_scheduled, cap.computed_before, cap.num_tokens_before, strict=True)
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
                                                           cap.computed_before, cap.num_tokens_before, strict=True)
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
