"""Shared set-up of the Triton kernel tests: the interpreter, random paged caches and block tables.

Importing this module turns the Triton interpreter on. The kernels are decorated on their first
launch (kernels/triton_jit.py), so this works whatever the tests imported before.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

# fp32 compares at rounding level; fp16 loses ~3 decimal digits in the kernel's fp16 loads and P@V
TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3}


def make_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype, gen):
    shape = (num_blocks * block_size, num_kv_heads, head_dim)
    return torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype)


def make_block_tables(context_lens: list[int], block_size: int, num_blocks: int, gen) -> torch.Tensor:
    """Each sequence gets scattered block ids (a random permutation of the pool, not 0, 1, 2, ...), and
    the second sequence starts with the first one's first block, as a shared prefix would. Padding
    columns hold a block id that is never read."""
    need = [-(-n // block_size) for n in context_lens]
    width = max(need + [1]) + 1  # one spare column: tables are wider than the longest context
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    assert sum(need) <= num_blocks, "pool too small for the contexts"
    tables = torch.full((len(context_lens), width), num_blocks - 1, dtype=torch.int32)
    taken = 0
    for i, n in enumerate(need):
        tables[i, :n] = torch.tensor(perm[taken:taken + n], dtype=torch.int32)
        taken += n
    if len(need) > 1 and need[0] and need[1]:
        tables[1, 0] = tables[0, 0]
    return tables
