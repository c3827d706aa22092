"""The paged KV cache's bookkeeping: a fixed pool of fixed-size blocks and one block table per request.

Blocks are handed out on demand, just before a step computes the tokens that need them, so a request
never holds more than one partly filled block. They return to the pool when the request finishes,
is aborted or is preempted.
"""

from __future__ import annotations

from collections import deque


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free_block_ids: deque[int] = deque(range(num_blocks))
        self.block_tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free_block_ids)

    @property
    def usage(self) -> float:
        """Fraction of the pool in use (vLLM's kv_cache_usage_perc, in [0, 1])."""
        return self.num_used_blocks / self.num_blocks

    def num_blocks_to_hold(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, request_id: str, num_tokens: int) -> int:
        """Blocks the request lacks to hold `num_tokens` tokens in total."""
        held = len(self.block_tables.get(request_id, ()))
        return max(0, self.num_blocks_to_hold(num_tokens) - held)

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        return self.num_new_blocks(request_id, num_tokens) <= len(self._free_block_ids)

    def allocate(self, request_id: str, num_tokens: int) -> list[int]:
        """Grow the request's block table to hold `num_tokens` tokens; returns the table."""
        table = self.block_tables.setdefault(request_id, [])
        needed = self.num_blocks_to_hold(num_tokens) - len(table)
        if needed > len(self._free_block_ids):
            raise RuntimeError(
                f"allocate({request_id!r}, {num_tokens}) needs {needed} blocks, {len(self._free_block_ids)} free"
            )
        for _ in range(needed):
            table.append(self._free_block_ids.popleft())
        return table

    def free(self, request_id: str) -> None:
        table = self.block_tables.pop(request_id, None)
        if table:
            # Most recently freed blocks are reused last, so a block id is not recycled within a step.
            self._free_block_ids.extend(table)

    def num_allocated_slots(self) -> int:
        return self.num_used_blocks * self.block_size
