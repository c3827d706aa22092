"""Random paged K/V caches for the CPU attention kernels' tests."""

from __future__ import annotations

import torch


def shuffled_paged_cache(context_lens: list[int], block_size: int, num_kv_heads: int, head_dim: int,
                         gen: torch.Generator, dtype: torch.dtype, spare_blocks: int):
    """Caches with `spare_blocks` more blocks than the requests use, handed out in shuffled order, so block
    tables are neither contiguous nor increasing; tables padded with block 0. -> (tables, k_cache, v_cache)"""
    per_req = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(per_req) + spare_blocks
    ids = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(context_lens), max(per_req), dtype=torch.long)
    taken = 0
    for r, nb in enumerate(per_req):
        tables[r, :nb] = ids[taken : taken + nb]
        taken += nb
    shape = (num_blocks * block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    return tables, k_cache, v_cache
