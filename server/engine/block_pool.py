"""The KV pool's physical blocks: reference counts, the free blocks, and the prefix cache's index of full
blocks by the hash of their content (vLLM v1's BlockPool).

A block is in use (its reference count says by how many requests: one physical block can serve every
request that shares its prefix) or free. A free block is either uncached, and handed out first, or
cached: it still holds the K/V of a full block of some prefix and can be found by that prefix's hash,
until the pool needs it for new content (least recently freed first). Found again, it comes back into
use without being computed.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence

BlockHash = bytes
_ROOT = bytes(16)  # the parent of a prompt's first block


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra_keys: bytes = b"") -> BlockHash:
    """The hash of one full block: its parent's hash chained with its token ids and the extra keys that
    change its K/V (none today; a LoRA adapter or multimodal inputs will), so equal hashes mean equal
    whole prefixes. 128-bit BLAKE2b: a collision, which would serve one prefix another's K/V, is out of
    reach, unlike with Python's 64-bit hash() of a tuple."""
    h = hashlib.blake2b(parent or _ROOT, digest_size=16)
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        h.update(len(extra_keys).to_bytes(4, "little"))
        h.update(extra_keys)
    return h.digest()


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[BlockHash | None] = [None] * num_blocks  # set while a block is findable
        # Uncached free blocks go out oldest-freed first, so a block id is not recycled within a step.
        self._uncached: deque[int] = deque(range(num_blocks))
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # least recently freed first
        self._by_hash: dict[BlockHash, int] = {}
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        """Free blocks, cached ones included: a cached free block is evicted when it is needed."""
        return len(self._uncached) + len(self._cached_free)

    @property
    def num_cached_free(self) -> int:
        return len(self._cached_free)

    @property
    def num_cached(self) -> int:
        """Blocks that can be found by hash, in use or free."""
        return len(self._by_hash)

    def free_block_ids(self) -> list[int]:
        return [*self._uncached, *self._cached_free]

    def cached_blocks(self) -> dict[BlockHash, int]:
        """Every findable block by hash (a copy, for checks and tests)."""
        return dict(self._by_hash)

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self._by_hash.get(block_hash)

    def take(self, n: int) -> list[int]:
        """`n` free blocks for new content, each with one reference: uncached ones first, then the least
        recently freed cached ones, whose hash is forgotten (evicted)."""
        if n > self.num_free:
            raise RuntimeError(f"{n} blocks asked for, {self.num_free} free")
        taken = []
        for _ in range(n):
            if self._uncached:
                block = self._uncached.popleft()
            else:
                block, _ = self._cached_free.popitem(last=False)
                block_hash = self.block_hashes[block]
                assert block_hash is not None  # a cached free block keeps its hash until reused here
                del self._by_hash[block_hash]
                self.block_hashes[block] = None
                self.num_evictions += 1
            self.ref_counts[block] = 1
            taken.append(block)
        return taken

    def share(self, block_ids: Iterable[int]) -> None:
        """One more reference on each of these cached blocks (a free one comes back into use)."""
        for block in block_ids:
            if self.ref_counts[block] == 0:
                del self._cached_free[block]
            self.ref_counts[block] += 1

    def release(self, block_ids: Iterable[int]) -> None:
        """One reference less on each block, in this order: a block nobody uses any more is free, and a
        cached one stays findable (the earlier in `block_ids`, the sooner it is evicted)."""
        for block in block_ids:
            count = self.ref_counts[block] - 1
            if count < 0:
                raise RuntimeError(f"block {block} released more often than taken")
            self.ref_counts[block] = count
            if count == 0:
                if self.block_hashes[block] is None:
                    self._uncached.append(block)
                else:
                    self._cached_free[block] = None

    def register(self, block_id: int, block_hash: BlockHash) -> None:
        """Make a full, computed block in use findable by its hash. If a block with the same content
        is findable already (two requests computed the same prefix at once), that one stays the cached
        copy and this one is freed uncached in the end."""
        if not self.enable_caching or block_hash in self._by_hash or self.block_hashes[block_id] is not None:
            return
        self.block_hashes[block_id] = block_hash
        self._by_hash[block_hash] = block_id

    def reset(self) -> int:
        """Forget every hash: nothing is found any more until blocks are computed again. Blocks in use
        stay with their requests (they free uncached). Returns how many blocks were findable."""
        dropped = len(self._by_hash)
        self._by_hash.clear()
        self._uncached.extend(self._cached_free)
        self._cached_free.clear()
        self.block_hashes = [None] * self.num_blocks
        return dropped
