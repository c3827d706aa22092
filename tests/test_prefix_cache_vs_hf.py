"""Greedy outputs with prefix caching on equal those with it off and HF transformers' token for token:
requests sharing prefixes of every kind of length (inside a block, on a block boundary, the whole
prompt), at once and one after another, under chunked prefill, forced preemption, eviction from a small
pool, the static policy and live knob changes. Each test also checks that the cache was in fact hit."""

from __future__ import annotations

import random

import pytest

from iterserve.server.engine.sampling_params import SamplingParams
from tests.conftest import make_engine
from tests.test_engine_vs_hf import assert_matches_hf, run

BLOCK = 16


def shared_prefix_items(n: int, seed: int, prefix_lens=(5, 16, 32, 37), max_suffix: int = 20, max_out: int = 24):
    """`n` requests; each begins with one of a few random prefixes, of each length in `prefix_lens`
    (within a block, exactly one or two blocks, past a boundary), then a suffix of 0 (the whole prompt
    shared) to `max_suffix` tokens of its own."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 320) for _ in range(length)] for length in prefix_lens]
    items = []
    for i in range(n):
        suffix_len = 0 if i % 5 == 0 or not max_suffix else rng.randint(1, max_suffix)
        suffix = [rng.randrange(1, 320) for _ in range(suffix_len)]
        items.append((prefixes[i % len(prefixes)] + suffix, rng.randint(1, max_out)))
    return items


def run_both(tiny, items, **options):
    """Caching on, then off: both must match HF; returns the engine with caching on."""
    path = tiny[0]
    on = make_engine(path, **options)
    assert on.block_manager.enable_caching
    assert_matches_hf(tiny, run(on, items), items)
    off = make_engine(path, enable_prefix_caching=False, **options)
    assert_matches_hf(tiny, run(off, items), items)
    assert off.stats.prefix_cache_hits == 0 and off.block_manager.pool.num_cached == 0
    return on


def test_a_repeated_prompt_is_served_from_the_cache(tiny_model):
    path, _ = tiny_model
    items = shared_prefix_items(1, seed=1, prefix_lens=(40,), max_suffix=0)
    engine = make_engine(path)
    first = run(engine, items)
    second = run(engine, items)  # one request at a time: the second finds the first one's blocks
    assert first[0].num_cached_tokens == 0 and second[0].num_cached_tokens == 32  # 2 whole blocks, not the last token
    assert (engine.stats.prefix_cache_queries, engine.stats.prefix_cache_hits) == (80, 32)
    assert_matches_hf(tiny_model, first + second, items + items)


@pytest.mark.parametrize("prompt_len", [16, 17, 31, 32, 33])
def test_a_prompt_of_whole_blocks_computes_its_last_token(tiny_llama, prompt_len):
    items = shared_prefix_items(1, seed=prompt_len, prefix_lens=(prompt_len,), max_suffix=0)
    engine = make_engine(tiny_llama[0])
    run(engine, items)
    again = run(engine, items)
    assert again[0].num_cached_tokens == (prompt_len - 1) // BLOCK * BLOCK
    assert_matches_hf(tiny_llama, again, items)


def test_sixteen_concurrent_requests_sharing_prefixes(tiny_model):
    # all added before the first step: later ones in that step find the blocks earlier ones compute in it
    items = shared_prefix_items(16, seed=2)
    engine = run_both(tiny_model, items, max_num_seqs=16)
    assert engine.stats.prefix_cache_hits > 0


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_with_shared_prefixes(tiny_model, chunk):
    items = shared_prefix_items(8, seed=3, max_suffix=40)
    engine = run_both(tiny_model, items, prefill_chunk_size=chunk, max_num_batched_tokens=max(chunk, 16))
    assert engine.stats.prefix_cache_hits > 0


def test_forced_preemption_with_shared_prefixes(tiny_model):
    items = shared_prefix_items(12, seed=4, max_out=80)
    # 512 B per token: 24 blocks of 16 tokens for 12 requests of up to 57 + 80 tokens
    engine = run_both(tiny_model, items, kv_cache_memory=24 * 16 * 512, max_model_len=160, max_num_seqs=12)
    assert engine.stats.num_preemptions > 0 and engine.stats.prefix_cache_hits > 0


def test_eviction_under_a_small_pool(tiny_llama):
    path, model = tiny_llama
    rng = random.Random(5)
    # 12 distinct 48-token prompts one after another through 10 blocks (3 blocks each): the oldest
    # prefixes are evicted; then the first (evicted) and the last (still cached) come again
    prompts = [[rng.randrange(1, 320) for _ in range(48)] for _ in range(12)]
    engine = make_engine(path, kv_cache_memory=10 * 16 * 512, max_model_len=64)
    assert engine.block_manager.num_blocks == 10
    outputs = []
    for p in prompts + [prompts[0], prompts[-1]]:
        outputs += run(engine, [(p, 8)])
    assert engine.block_manager.pool.num_evictions > 0
    assert outputs[-2].num_cached_tokens == 0  # evicted long ago
    assert outputs[-1].num_cached_tokens == 32  # its blocks are the most recently freed
    assert_matches_hf(tiny_llama, outputs, [(p, 8) for p in prompts + [prompts[0], prompts[-1]]])


def test_static_policy_and_knob_changes_with_shared_prefixes(tiny_llama):
    items = shared_prefix_items(10, seed=6, max_suffix=30)
    engine = run_both(tiny_llama, items, policy="static", max_num_seqs=4)
    assert engine.stats.prefix_cache_hits > 0
    plan = {1: dict(max_num_seqs=2), 4: dict(prefill_chunk_size=3, max_num_batched_tokens=8), 12: dict(max_num_seqs=16)}
    engine = make_engine(tiny_llama[0], max_num_seqs=8)
    outputs = run(engine, items, on_step=lambda step, e: plan.get(step) and e.update_knobs(**plan[step]))
    assert engine.stats.prefix_cache_hits > 0
    assert_matches_hf(tiny_llama, outputs, items)


def test_reset_forgets_every_prefix(tiny_llama):
    items = shared_prefix_items(1, seed=7, prefix_lens=(40,), max_suffix=0)
    engine = make_engine(tiny_llama[0])
    run(engine, items)
    cached = engine.block_manager.num_cached_free_blocks
    assert cached >= 2  # the prompt's 2 whole blocks, and any its output filled
    assert engine.reset_prefix_cache() == cached
    assert engine.block_manager.num_cached_free_blocks == 0
    again = run(engine, items)
    assert again[0].num_cached_tokens == 0
    assert_matches_hf(tiny_llama, again, items)


def test_aborted_requests_leave_reusable_blocks(tiny_llama):
    items = shared_prefix_items(2, seed=8, prefix_lens=(40,), max_suffix=0, max_out=30)
    engine = make_engine(tiny_llama[0])
    rid = engine.add_request(prompt_token_ids=items[0][0],
                             sampling_params=SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    for _ in range(3):
        engine.step()
    engine.abort_request(rid)
    engine.step()
    assert engine.block_manager.num_used_blocks == 0 and engine.block_manager.num_cached_free_blocks >= 2
    out = run(engine, items[:1])
    assert out[0].num_cached_tokens == 32
    assert_matches_hf(tiny_llama, out, items[:1])
