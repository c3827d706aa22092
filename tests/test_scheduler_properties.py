"""Property tests of the scheduler and the KV block bookkeeping, prefix caching included, driven through
LLMEngine.step() with the KVTraceRunner (no model: each next token is a function of the prefix read back
from an emulated paged KV cache, so a block shared or found wrongly makes a wrong token).

A hypothesis state machine adds requests, aborts them, changes the live knobs and steps the engine,
checking after every step the invariants of ScheduleChecks (tests/scheduler_checks.py: _check_schedule,
_check_outputs, _check_state); its teardown drains the engine and checks every request's outcome.
tests/test_scheduler_cases.py forces preemption deterministically and checks that the tokens a request
gets do not depend on the knobs or the policy.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule

from iterserve.common.wire import Knobs
from iterserve.server.errors import InvalidRequestError
from tests.kv_trace_runner import VOCAB
from tests.scheduler_checks import ScheduleChecks
from tests.scheduler_support import (
    KNOB_NAMES,
    Captured,
    Tracked,
    cdiv,
    eng_hits,
    make_engine,
    make_prompt,
    params,
    reference_output,
)

# ---------------------------------------------------------------------------------------------------
# the state machine
# ---------------------------------------------------------------------------------------------------


class EngineMachine(ScheduleChecks, RuleBasedStateMachine):
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
        self.knobs = Knobs(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
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


TestContinuousPolicy = ContinuousMachine.TestCase
TestContinuousPolicy.settings = MACHINE_SETTINGS
TestStaticPolicy = StaticMachine.TestCase
TestStaticPolicy.settings = MACHINE_SETTINGS
TestContinuousPolicyWithoutPrefixCaching = ContinuousNoCacheMachine.TestCase
TestContinuousPolicyWithoutPrefixCaching.settings = MACHINE_SETTINGS
