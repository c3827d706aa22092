"""Unit tests of prefix caching's bookkeeping: block hashes, the pool's reference counts and eviction
order (server/engine/block_pool.py), and lookups and allocation from a cached prefix
(server/engine/block_manager.py)."""

from __future__ import annotations

import pytest

from iterserve.common.wire import Knobs
from iterserve.server.engine.block_manager import BlockManager
from iterserve.server.engine.block_pool import BlockPool, hash_block
from iterserve.server.engine.llm_engine import LLMEngine
from iterserve.server.engine.sampling_params import SamplingParams
from tests.kv_trace_runner import KVTraceRunner, next_token


def test_a_block_hash_chains_its_whole_prefix():
    a = hash_block(None, [1, 2, 3, 4])
    assert a == hash_block(None, [1, 2, 3, 4]) and len(a) == 16
    assert hash_block(a, [5, 6, 7, 8]) != hash_block(None, [5, 6, 7, 8])  # same tokens, other prefix
    assert hash_block(a, [5, 6, 7, 8]) != hash_block(hash_block(None, [1, 2, 3, 9]), [5, 6, 7, 8])
    assert hash_block(None, [1, 2]) != hash_block(None, [2, 1])
    # extra keys (a LoRA adapter, multimodal inputs) make a different block of the same tokens
    assert hash_block(None, [1, 2], b"lora-1") != hash_block(None, [1, 2])
    assert hash_block(None, [1, 2], b"lora-1") != hash_block(None, [1, 2], b"lora-2")


def _prompt(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def _fill(bm: BlockManager, rid: str, tokens: list[int]) -> list[int]:
    """Admit `rid` from its cached prefix and compute all of its tokens in one go."""
    cached = bm.find_cached_prefix(rid, tokens)
    assert bm.can_allocate(rid, len(tokens), cached)
    return list(bm.allocate(rid, len(tokens), tokens, cached))


def test_full_blocks_are_found_and_the_last_token_never_is():
    bm = BlockManager(16, 4)
    table = _fill(bm, "a", _prompt(10))  # blocks: 4 + 4 full, 2 partial
    assert bm.pool.num_cached == 2
    assert bm.find_cached_prefix("b", _prompt(10)) == table[:2]
    assert bm.find_cached_prefix("c", _prompt(9)) == table[:2]  # 8 found, the 9th computed
    assert bm.find_cached_prefix("d", _prompt(8)) == table[:1]  # a whole-block prompt: its last token is computed
    assert bm.find_cached_prefix("e", _prompt(5)) == table[:1]
    assert bm.find_cached_prefix("f", _prompt(4)) == []
    assert bm.find_cached_prefix("g", [7] + _prompt(9)[1:]) == []  # the first block differs: nothing after it counts
    assert bm.find_cached_prefix("h", _prompt(4) + [0, 0, 0, 0, 0]) == table[:1]


def test_shared_blocks_are_counted_and_freed_by_every_holder():
    bm = BlockManager(8, 4)
    a = _fill(bm, "a", _prompt(10))
    b = _fill(bm, "b", _prompt(10))
    assert b[:2] == a[:2] and b[2] != a[2]
    assert [bm.pool.ref_counts[x] for x in a] == [2, 2, 1] and bm.pool.ref_counts[b[2]] == 1
    assert bm.num_used_blocks == 4 and bm.usage == 0.5
    bm.free("a")
    assert [bm.pool.ref_counts[x] for x in a] == [1, 1, 0] and bm.num_used_blocks == 3
    bm.free("b")
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 8 and bm.usage == 0.0
    assert bm.num_cached_free_blocks == 2  # a's two full blocks: free, and still cached


def test_a_cached_free_block_taken_back_counts_against_the_free_ones():
    bm = BlockManager(3, 4)
    a = _fill(bm, "a", _prompt(9))  # 3 blocks, 2 of them cached when freed
    bm.free("a")
    cached = bm.find_cached_prefix("b", _prompt(9))
    assert cached == a[:2] and bm.num_free_blocks == 3
    # 2 cached blocks revived + 1 new block: the whole pool
    assert bm.can_allocate("b", 9, cached) and not bm.can_allocate("b", 13, cached)
    assert bm.allocate("b", 9, _prompt(9), cached)[:2] == a[:2]
    assert bm.num_free_blocks == 0


def test_uncached_blocks_go_first_then_the_least_recently_freed_cached_tail_first():
    bm = BlockManager(6, 2)
    a = _fill(bm, "a", _prompt(5))  # 2 full blocks + 1 partial
    bm.free("a")
    b = _fill(bm, "b", _prompt(5, start=500))
    bm.free("b")
    assert bm.num_cached_free_blocks == 4 and bm.free_block_ids()[:2] == [a[2], b[2]]
    # the 2 uncached blocks first, then eviction: a's tail block, then a's head, then b's tail
    c = bm.allocate("c", 10)
    assert c[:2] == [a[2], b[2]] and c[2:] == [a[1], a[0], b[1]]
    assert bm.pool.num_evictions == 3
    assert bm.find_cached_prefix("a2", _prompt(5)) == []
    assert bm.find_cached_prefix("b2", _prompt(5, start=500)) == [b[0]]  # its head is still cached


def test_two_requests_computing_the_same_block_keep_one_copy_cached():
    bm = BlockManager(8, 4)
    a = _fill(bm, "a", _prompt(4) + [1])
    b = bm.allocate("b", 5, _prompt(4) + [2])  # not looked up: computed again, as by a request admitted earlier
    assert a[0] != b[0] and bm.pool.num_cached == 1 and bm.pool.lookup(hash_block(None, _prompt(4))) == a[0]
    bm.free("a")
    bm.free("b")
    assert bm.num_cached_free_blocks == 1


def test_registration_grows_with_the_computed_tokens():
    bm = BlockManager(8, 4)
    tokens = _prompt(12)
    for n in (3, 4, 7, 8, 11):  # a prefill in chunks, then decodes
        bm.allocate("a", n, tokens)
        assert bm.pool.num_cached == n // 4


def test_reset_forgets_free_and_used_blocks_alike():
    bm = BlockManager(8, 4)
    _fill(bm, "a", _prompt(9))
    _fill(bm, "b", _prompt(9, start=300))
    bm.free("b")
    assert bm.reset_prefix_cache() == 4
    assert bm.pool.num_cached == bm.num_cached_free_blocks == 0
    assert bm.find_cached_prefix("c", _prompt(9)) == []
    assert bm.num_free_blocks == 5
    bm.free("a")
    assert bm.num_free_blocks == 8 and bm.num_cached_free_blocks == 0


def test_caching_off_registers_and_finds_nothing():
    bm = BlockManager(8, 4, enable_caching=False)
    _fill(bm, "a", _prompt(9))
    assert bm.pool.num_cached == 0 and bm.find_cached_prefix("b", _prompt(9)) == []
    bm.free("a")
    assert bm.num_cached_free_blocks == 0


def test_pool_refuses_more_than_it_has_and_double_frees():
    pool = BlockPool(2)
    blocks = pool.take(2)
    with pytest.raises(RuntimeError):
        pool.take(1)
    pool.release(blocks)
    with pytest.raises(RuntimeError):
        pool.release(blocks[:1])


class _FailingOnce(KVTraceRunner):
    fail = True

    def execute_model(self, out):
        if self.fail:
            self.fail = False
            raise RuntimeError("injected device failure")
        return super().execute_model(out)


def test_a_failed_step_forgets_the_blocks_it_was_to_fill():
    runner = _FailingOnce(block_size=4)
    eng = LLMEngine(runner, tokenizer=None, max_model_len=32, num_blocks=16, block_size=4,
                    knobs=Knobs(), vocab_size=1000)
    prompt = list(range(10))
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    eng.add_request(prompt_token_ids=prompt, sampling_params=params, request_id="a")
    with pytest.raises(RuntimeError, match="injected"):
        eng.step()  # its 2 full blocks were registered when it was scheduled, and never written
    assert eng.block_manager.pool.num_cached == 0
    eng.abort_request("a")
    eng.step()
    eng.add_request(prompt_token_ids=prompt, sampling_params=params, request_id="b")
    (out,) = eng.step()
    assert out.num_cached_tokens == 0 and out.token_ids == [next_token(prompt)]
    assert eng.block_manager.pool.num_cached == 2
