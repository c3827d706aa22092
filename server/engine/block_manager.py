"""The paged KV cache's bookkeeping: a fixed pool of fixed-size blocks and one block table per request,
with automatic prefix caching in the manner of vLLM v1.

Blocks are handed out on demand, just before a step computes the tokens that need them, so a request
never holds more than one partly filled block. They return to the pool when the request finishes, is
aborted or is preempted.

Prefix caching: each block a request fills completely is registered in the pool (block_pool.py) under a
hash chaining its parent's hash and its token ids, from the step that computes it: a request admitted
later in the same step may read it, because every layer writes the step's K/V before any attention
reads. A request being admitted looks up its longest prefix of full blocks (`find_cached_prefix`), takes
a reference on them and computes only the rest; the last prompt token is always computed, so there is a
position to sample from. Shared blocks are full and only ever read: a request writes its K/V from its
own computed count onward, which starts in a block of its own. Freed blocks of a prefix stay cached
until the pool needs them.
"""

from __future__ import annotations

from collections.abc import Sequence

from iterserve.server.engine.block_pool import BlockHash, BlockPool, hash_block


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.block_tables: dict[str, list[int]] = {}
        # per request: the hashes of its full blocks worked out so far, and how many leading blocks of its
        # table have been offered to the cache (found there or registered)
        self._hashes: dict[str, list[BlockHash]] = {}
        self._num_registered: dict[str, int] = {}

    @property
    def enable_caching(self) -> bool:
        return self.pool.enable_caching

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request uses, cached ones included (they are evicted when needed)."""
        return self.pool.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.pool.num_free

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a cached prefix."""
        return self.pool.num_cached_free

    @property
    def usage(self) -> float:
        """Fraction of the pool in use by requests (vLLM's kv_cache_usage_perc, in [0, 1]); cached blocks
        no request uses are free."""
        return self.num_used_blocks / self.num_blocks

    def free_block_ids(self) -> list[int]:
        return self.pool.free_block_ids()

    def num_blocks_to_hold(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, request_id: str, num_tokens: int) -> int:
        """Blocks the request lacks to hold `num_tokens` tokens in total."""
        held = len(self.block_tables.get(request_id, ()))
        return max(0, self.num_blocks_to_hold(num_tokens) - held)

    # -- the prefix cache ------------------------------------------------------------------------

    def block_hashes(self, request_id: str, token_ids: Sequence[int], num_blocks: int) -> list[BlockHash]:
        """The hashes of the request's first `num_blocks` full blocks (each worked out once)."""
        hashes = self._hashes.setdefault(request_id, [])
        bs = self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            hashes.append(hash_block(hashes[-1] if i else None, token_ids[i * bs:(i + 1) * bs]))
        return hashes

    def find_cached_prefix(self, request_id: str, token_ids: Sequence[int]) -> list[int]:
        """The cached blocks holding the longest prefix of `token_ids` in whole blocks, in order, short
        of the last token (which is always computed: the request samples from it). Takes nothing."""
        if not self.enable_caching:
            return []
        found: list[int] = []
        for i in range((len(token_ids) - 1) // self.block_size):
            block = self.pool.lookup(self.block_hashes(request_id, token_ids, i + 1)[i])
            if block is None:
                break
            found.append(block)
        return found

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (blocks in use stay with their requests); returns how many blocks
        were findable."""
        return self.pool.reset()

    # -- allocation ------------------------------------------------------------------------------

    def can_allocate(self, request_id: str, num_tokens: int, cached: Sequence[int] = ()) -> bool:
        """Whether the request can hold `num_tokens` tokens, starting from the `cached` blocks when it
        holds none yet (a cached block that is free counts against the free ones: it leaves the pool)."""
        missing = self.num_new_blocks(request_id, num_tokens) - len(cached)
        revived = sum(1 for b in cached if self.pool.ref_counts[b] == 0)
        return missing + revived <= self.pool.num_free

    def allocate(self, request_id: str, num_tokens: int, token_ids: Sequence[int] | None = None,
                 cached: Sequence[int] = ()) -> list[int]:
        """Grow the request's block table to hold `num_tokens` tokens, from the `cached` blocks when it
        holds none yet, and register its blocks that these tokens fill (when `token_ids` are given and
        caching is on). Returns the table."""
        table = self.block_tables.setdefault(request_id, [])
        if cached:
            if table:
                raise RuntimeError(f"allocate({request_id!r}): cached blocks for a request that holds blocks")
            if not self.can_allocate(request_id, num_tokens, cached):
                raise RuntimeError(f"allocate({request_id!r}, {num_tokens}) does not fit from "
                                   f"{len(cached)} cached blocks")
            self.pool.share(cached)
            table.extend(cached)
            self._num_registered[request_id] = len(cached)
        needed = self.num_blocks_to_hold(num_tokens) - len(table)
        if needed > self.pool.num_free:
            raise RuntimeError(f"allocate({request_id!r}, {num_tokens}) needs {needed} blocks, "
                               f"{self.pool.num_free} free")
        if needed > 0:
            table.extend(self.pool.take(needed))
        if token_ids is not None and self.enable_caching:
            self._register_full_blocks(request_id, table, token_ids, num_tokens)
        return table

    def _register_full_blocks(self, request_id: str, table: list[int], token_ids: Sequence[int],
                              num_tokens: int) -> None:
        full = min(num_tokens // self.block_size, len(table))
        start = self._num_registered.get(request_id, 0)
        if full <= start:
            return
        hashes = self.block_hashes(request_id, token_ids, full)
        for i in range(start, full):
            self.pool.register(table[i], hashes[i])
        self._num_registered[request_id] = full

    def free(self, request_id: str) -> None:
        table = self.block_tables.pop(request_id, None)
        self._hashes.pop(request_id, None)
        self._num_registered.pop(request_id, None)
        if table:
            # the last blocks first: of a prefix freed at once, its tail (the least likely shared) is
            # evicted first
            self.pool.release(reversed(table))

    def num_allocated_slots(self) -> int:
        return self.num_used_blocks * self.block_size
