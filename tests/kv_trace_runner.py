"""A model runner without a model whose tokens come from an emulated paged KV cache, for the property
tests of prefix caching.

Each slot of the emulated cache holds the K/V of one position as a real model's would depend on it: the
whole prefix up to and including that position (a tuple of token ids). A step writes, for every new
token, the prefix read from the cache at the position before (through the request's block table, as
attention reads it) plus the token itself, then samples from the prefix at the request's last position.
So a block read by the wrong request, overwritten while shared, or found under the wrong hash makes a
wrong token, and `check_cache` can say which block holds what.
"""

from __future__ import annotations

from iterserve.server.engine.block_pool import hash_block
from iterserve.server.engine.scheduler import SchedulerOutput
from iterserve.server.runner.null_runner import NullModelRunner
from iterserve.server.runner.sampler import ModelRunnerOutput

VOCAB = 1000


def next_token(prefix) -> int:
    """The token a request samples after `prefix` (all its tokens so far): a function of all of them."""
    return hash(tuple(prefix)) % VOCAB


class KVTraceRunner(NullModelRunner):
    def __init__(self, block_size: int, vocab_size: int = VOCAB, prepare_inputs: bool = True):
        super().__init__(block_size, vocab_size, prepare_inputs)
        self.kv: dict[int, tuple[int, ...]] = {}  # slot -> the prefix its K/V was computed from

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        super().execute_model(out)  # the real input preparation, whose tokens are discarded
        bs = self.block_size
        tokens = {}
        for s in out.scheduled:
            table = s.block_table
            for i, token in enumerate(s.new_token_ids):
                p = s.num_computed_tokens + i
                block = table[p // bs]
                before = self.kv.get(table[(p - 1) // bs] * bs + (p - 1) % bs, ()) if p else ()
                assert len(before) == p, f"{s.request_id} reads position {p - 1} holding {before}"
                self.kv[block * bs + p % bs] = before + (token,)
            if s.sampling_params is not None:
                p = s.num_computed_tokens + len(s.new_token_ids) - 1
                tokens[s.request_id] = next_token(self.kv[table[p // bs] * bs + p % bs])
        return ModelRunnerOutput(tokens, {}, {})

    def check_cache(self, bm, running) -> None:
        """Every running request's computed positions hold its own prefix, and every block findable in
        the prefix cache holds a whole prefix whose hash is the one it is found by."""
        bs = self.block_size
        for r in running:
            table = bm.block_tables[r.request_id]
            for p in range(r.num_computed_tokens):
                got = self.kv.get(table[p // bs] * bs + p % bs)
                assert got == tuple(r.token_ids[: p + 1]), (r, p, got)
        for block_hash, block in bm.pool.cached_blocks().items():
            assert bm.pool.block_hashes[block] == block_hash
            prefix = self.kv.get(block * bs + bs - 1, ())
            assert prefix and len(prefix) % bs == 0, (block, prefix)
            for j in range(bs):
                assert self.kv.get(block * bs + j) == prefix[: len(prefix) - bs + j + 1], (block, j)
            parent = None
            for i in range(len(prefix) // bs):
                parent = hash_block(parent, prefix[i * bs:(i + 1) * bs])
            assert parent == block_hash, f"block {block} holds {prefix}, not what its hash says"
