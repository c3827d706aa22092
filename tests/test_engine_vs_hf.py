"""Greedy outputs equal HF transformers' token for token, under batching, chunking and preemption."""

from __future__ import annotations

import random

import pytest

from iterserve.server.engine.sampling_params import SamplingParams
from tests.conftest import hf_greedy, make_engine

_reference_cache: dict[tuple, list[int]] = {}


def workload(n: int, seed: int = 0, max_prompt: int = 60, max_out: int = 40):
    rng = random.Random(seed)
    return [([rng.randrange(1, 320) for _ in range(rng.randint(1, max_prompt))], rng.randint(1, max_out))
            for _ in range(n)]


def reference(model_path, model, prompt, max_tokens):
    key = (model_path, tuple(prompt), max_tokens)
    if key not in _reference_cache:
        _reference_cache[key] = hf_greedy(model, prompt, max_tokens)
    return _reference_cache[key]


def run(engine, items, on_step=None):
    ids = [engine.add_request(prompt_token_ids=p, sampling_params=SamplingParams(
        max_tokens=n, temperature=0, ignore_eos=True)) for p, n in items]
    done = {}
    step = 0
    while engine.has_unfinished_requests():
        if on_step:
            on_step(step, engine)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        step += 1
        assert step < 10_000
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return [done[i] for i in ids]


def assert_matches_hf(tiny, outputs, items):
    path, model = tiny
    for out, (prompt, n) in zip(outputs, items, strict=True):
        assert out.finish_reason == "length"
        assert out.token_ids == reference(path, model, prompt, n), f"prompt of {len(prompt)} tokens"


def test_single_request(tiny_model):
    items = workload(1, seed=1)
    assert_matches_hf(tiny_model, run(make_engine(tiny_model[0]), items), items)


def test_sixteen_concurrent_requests(tiny_model):
    items = workload(16, seed=2)
    engine = make_engine(tiny_model[0], max_num_seqs=16)
    assert_matches_hf(tiny_model, run(engine, items), items)


def test_torch_attention_path_in_padded_groups(tiny_model, monkeypatch):
    """The kill switch's path: 40 decodes split into groups of similar context, masked on first use."""
    monkeypatch.setenv("ITERSERVE_CPU_ATTENTION", "torch")
    items = workload(40, seed=5, max_out=20)
    engine = make_engine(tiny_model[0], max_num_seqs=40)
    assert_matches_hf(tiny_model, run(engine, items), items)


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill(tiny_model, chunk):
    items = workload(8, seed=3, max_prompt=100)
    engine = make_engine(tiny_model[0], prefill_chunk_size=chunk, max_num_batched_tokens=max(chunk, 16))
    assert_matches_hf(tiny_model, run(engine, items), items)


def test_preemption_under_a_small_kv_pool(tiny_model):
    items = workload(12, seed=4, max_prompt=40, max_out=80)
    # 2 layers x 2 KV heads x 16 dims x fp32 x K,V = 512 B per token: 24 blocks of 16 tokens
    engine = make_engine(tiny_model[0], kv_cache_memory=24 * 16 * 512, max_model_len=128, max_num_seqs=12)
    assert engine.block_manager.num_blocks == 24
    outputs = run(engine, items)
    assert engine.stats.num_preemptions > 0
    assert sum(o.num_preemptions for o in outputs) == engine.stats.num_preemptions
    assert_matches_hf(tiny_model, outputs, items)


def test_static_policy(tiny_model):
    items = workload(10, seed=5)
    engine = make_engine(tiny_model[0], policy="static", max_num_seqs=4)
    assert_matches_hf(tiny_model, run(engine, items), items)


def test_knob_changes_mid_run(tiny_model):
    items = workload(16, seed=6, max_prompt=80)
    plan = {2: dict(max_num_seqs=2), 6: dict(prefill_chunk_size=3, max_num_batched_tokens=8),
            15: dict(max_num_seqs=16, prefill_chunk_size=64, max_num_batched_tokens=128), 30: dict(max_num_seqs=1)}
    seen = []

    def change(step, engine):
        if step in plan:
            engine.update_knobs(**plan[step])
        seen.append(len(engine.scheduler.running))

    engine = make_engine(tiny_model[0], max_num_seqs=8)
    outputs = run(engine, items, on_step=change)
    assert engine.knobs.num_changes == len(plan)
    assert_matches_hf(tiny_model, outputs, items)
