"""Deterministic tests of the scheduler through LLMEngine.step() with the KVTraceRunner (forced
preemption, aborts, request ids), and the property that the tokens a request gets do not depend on the
knobs, the block size, the policy or prefix caching."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from iterserve.common.wire import Knobs
from iterserve.server.engine.llm_engine import LLMEngine
from iterserve.server.errors import InvalidRequestError
from tests.kv_trace_runner import VOCAB
from tests.scheduler_support import cdiv, make_engine, make_prompt, params, reference_output

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
                      knobs=Knobs(max_num_seqs=3, max_num_batched_tokens=16, prefill_chunk_size=4),
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
                      knobs=Knobs(max_num_seqs=2, max_num_batched_tokens=8, prefill_chunk_size=8))
    eng.add_request(prompt_token_ids=[5, 6], sampling_params=params(5), request_id="old")
    eng.add_request(prompt_token_ids=[7, 8], sampling_params=params(5), request_id="new")
    finals = run_to_completion(eng)
    assert eng.stats.num_preemptions > 0
    assert finals["old"] == [reference_output([5, 6], 5, 8), "length"]
    assert finals["new"] == [reference_output([7, 8], 5, 8), "length"]


def test_engine_refuses_a_pool_smaller_than_max_model_len():
    with pytest.raises(InvalidRequestError):
        make_engine(policy="continuous", block_size=4, num_blocks=3, max_model_len=13,
                    knobs=Knobs())
    make_engine(policy="continuous", block_size=4, num_blocks=4, max_model_len=16, knobs=Knobs())


def test_abort_of_finished_or_unknown_request_yields_nothing():
    eng = make_engine(policy="continuous", block_size=4, num_blocks=8, max_model_len=16,
                      knobs=Knobs(max_num_seqs=2, max_num_batched_tokens=16, prefill_chunk_size=8))
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
    "knobs": st.builds(Knobs, max_num_seqs=st.integers(1, 6), max_num_batched_tokens=st.integers(1, 48),
                       prefill_chunk_size=st.integers(1, 24)),
    # a live knob change at some step (None: none)
    "change_at": st.none() | st.integers(0, 30),
    "new_knobs": st.builds(Knobs, max_num_seqs=st.integers(1, 6),
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
                      knobs=Knobs(max_num_seqs=4, max_num_batched_tokens=16, prefill_chunk_size=8))
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
                      knobs=Knobs(max_num_seqs=4, max_num_batched_tokens=16, prefill_chunk_size=8))
    for prompt in ([1, 2, 3], [4, 5, 6, 7, 8]):
        eng.add_request(prompt_token_ids=prompt, sampling_params=params(4), request_id="x")
        assert run_to_completion(eng, max_steps=100) == {"x": [reference_output(prompt, 4, 16), "length"]}
    assert eng.block_manager.num_free_blocks == 8
