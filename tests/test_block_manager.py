"""Unit tests of the paged KV cache's bookkeeping (server/engine/block_manager.py)."""

from __future__ import annotations

import pytest

from iterserve.server.engine.block_manager import BlockManager


def _owned(bm: BlockManager) -> list[int]:
    return [b for table in bm.block_tables.values() for b in table]


def _check_conservation(bm: BlockManager) -> None:
    owned = _owned(bm)
    assert len(owned) == len(set(owned)), "a block is owned twice"
    free = bm.free_block_ids()
    assert len(free) == len(set(free)), "a block is free twice"
    assert not set(owned) & set(free), "a block is both owned and free"
    assert sorted(owned + free) == list(range(bm.num_blocks))
    assert bm.num_used_blocks == len(owned)
    assert bm.num_free_blocks == len(free)


@pytest.mark.parametrize("num_blocks, block_size", [(0, 4), (-1, 4), (4, 0), (4, -2)])
def test_rejects_empty_pool_or_block(num_blocks, block_size):
    with pytest.raises(ValueError):
        BlockManager(num_blocks, block_size)


@pytest.mark.parametrize(
    "block_size, num_tokens, blocks",
    [(1, 0, 0), (1, 1, 1), (1, 7, 7), (4, 0, 0), (4, 1, 1), (4, 4, 1), (4, 5, 2), (4, 8, 2), (4, 9, 3),
     (8, 63, 8), (8, 64, 8), (8, 65, 9), (16, 1, 1)],
)
def test_num_blocks_to_hold(block_size, num_tokens, blocks):
    bm = BlockManager(100, block_size)
    assert bm.num_blocks_to_hold(num_tokens) == blocks
    assert bm.num_new_blocks("r", num_tokens) == blocks
    table = bm.allocate("r", num_tokens)
    assert len(table) == blocks
    _check_conservation(bm)


def test_fresh_pool():
    bm = BlockManager(10, 4)
    assert (bm.num_free_blocks, bm.num_used_blocks, bm.usage, bm.num_allocated_slots()) == (10, 0, 0.0, 0)
    assert bm.block_tables == {}
    _check_conservation(bm)


# (tokens requested by successive allocate calls of one request, expected table length after each)
@pytest.mark.parametrize(
    "steps",
    [
        [(1, 1), (2, 1), (4, 1), (5, 2), (5, 2), (12, 3), (13, 4)],  # decode-like growth
        [(8, 2), (16, 4)],  # chunked prefill
        [(9, 3), (3, 3)],  # asking for fewer tokens never shrinks the table
        [(0, 0), (1, 1)],
    ],
)
def test_on_demand_growth(steps):
    bm = BlockManager(8, 4)
    seen: list[int] = []
    for num_tokens, expected_len in steps:
        table = bm.allocate("r", num_tokens)
        assert len(table) == expected_len
        assert table[: len(seen)] == seen, "growth must keep the blocks already held, in order"
        seen = list(table)
        assert bm.block_tables["r"] is table
        assert bm.num_new_blocks("r", num_tokens) == 0
        assert bm.num_used_blocks == expected_len
        _check_conservation(bm)


def test_can_allocate_counts_only_missing_blocks():
    bm = BlockManager(4, 4)
    bm.allocate("a", 8)  # 2 blocks
    assert bm.can_allocate("a", 16)  # needs 2 more: exactly what is free
    assert not bm.can_allocate("a", 17)  # needs 3 more
    assert bm.can_allocate("b", 8)
    assert not bm.can_allocate("b", 9)
    assert bm.can_allocate("a", 1)  # already held
    assert bm.num_new_blocks("a", 17) == 3
    assert bm.num_new_blocks("a", 3) == 0


@pytest.mark.parametrize(
    "num_blocks, block_size, held_tokens, request_tokens",
    [(4, 4, 0, 17), (4, 4, 8, 17), (1, 1, 0, 2), (3, 2, 6, 7)],
)
def test_over_allocation_raises_and_changes_nothing(num_blocks, block_size, held_tokens, request_tokens):
    bm = BlockManager(num_blocks, block_size)
    if held_tokens:
        bm.allocate("other", held_tokens)
    before_free = bm.free_block_ids()
    before_tables = {k: list(v) for k, v in bm.block_tables.items()}
    assert not bm.can_allocate("r", request_tokens)
    with pytest.raises(RuntimeError):
        bm.allocate("r", request_tokens)
    assert bm.free_block_ids() == before_free
    assert {k: v for k, v in bm.block_tables.items() if v} == before_tables
    _check_conservation(bm)


def test_over_allocating_an_existing_table_keeps_it():
    bm = BlockManager(4, 2)
    table = list(bm.allocate("r", 3))
    with pytest.raises(RuntimeError):
        bm.allocate("r", 9)
    assert bm.block_tables["r"] == table
    _check_conservation(bm)


def test_free_returns_every_block():
    bm = BlockManager(10, 4)
    bm.allocate("a", 9)  # 3
    bm.allocate("b", 4)  # 1
    bm.allocate("c", 20)  # 5
    assert bm.num_free_blocks == 1
    b_blocks = list(bm.block_tables["b"])
    bm.free("b")
    assert "b" not in bm.block_tables
    assert bm.num_free_blocks == 2
    assert set(b_blocks) <= set(bm.free_block_ids())
    _check_conservation(bm)
    bm.free("a")
    bm.free("c")
    assert bm.num_free_blocks == 10 and bm.block_tables == {} and bm.usage == 0.0
    _check_conservation(bm)


def test_free_unknown_or_twice_is_harmless():
    bm = BlockManager(4, 4)
    bm.free("nobody")
    bm.allocate("a", 5)
    bm.free("a")
    bm.free("a")
    assert bm.num_free_blocks == 4
    _check_conservation(bm)


def test_freed_blocks_are_reused_last():
    bm = BlockManager(4, 1)
    bm.allocate("a", 2)  # blocks 0, 1
    freed = list(bm.block_tables["a"])
    bm.free("a")
    table = bm.allocate("b", 2)
    assert not set(table) & set(freed), "recently freed blocks should be handed out after the others"
    _check_conservation(bm)


def test_a_freed_pool_can_be_filled_again():
    bm = BlockManager(6, 2)
    for round_ in range(3):
        for rid in ("a", "b", "c"):
            bm.allocate(f"{rid}{round_}", 4)
        assert bm.num_free_blocks == 0
        assert not bm.can_allocate("x", 1)
        _check_conservation(bm)
        for rid in ("a", "b", "c"):
            bm.free(f"{rid}{round_}")
        assert bm.num_free_blocks == 6


@pytest.mark.parametrize(
    "num_blocks, block_size, allocations, usage, slots",
    [
        (10, 4, {}, 0.0, 0),
        (10, 4, {"a": 1}, 0.1, 4),
        (10, 4, {"a": 5, "b": 4}, 0.3, 12),
        (4, 8, {"a": 32}, 1.0, 32),
        (3, 1, {"a": 1, "b": 1}, 2 / 3, 2),
    ],
)
def test_usage_and_allocated_slots(num_blocks, block_size, allocations, usage, slots):
    bm = BlockManager(num_blocks, block_size)
    for rid, n in allocations.items():
        bm.allocate(rid, n)
    assert bm.usage == pytest.approx(usage)
    assert 0.0 <= bm.usage <= 1.0
    assert bm.num_allocated_slots() == slots
