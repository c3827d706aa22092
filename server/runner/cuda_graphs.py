"""Decode steps from static buffers, replayed as CUDA graphs, one graph per batch-size bucket.

A step in which every request computes one token launches the same kernels for a given batch size.
Its inputs are padded to the next bucket and copied into static buffers; padded rows write nothing
(slot -1) and attend to nothing (context 0). A bucket's graph is captured on its first use, right
after one eager run over the same buffers (which compiles the Triton kernels for those shapes and
computes that step). Without capture (`capture=False`: CPU, tests) the same static-buffer path runs
eagerly, so everything but the capture itself is exercised on CPU.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from iterserve.kernels.attention_metadata import DecodeBatch, TritonAttentionMetadata
from iterserve.server.runner.step_inputs import StepLayout


def capture_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 (vLLM's buckets), and max_batch itself: at most 7 padded rows."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    sizes = {s for s in (1, 2, 4) if s <= max_batch} | set(range(8, max_batch + 1, 8)) | {max_batch}
    return sorted(sizes)


def bucket_for(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest bucket holding num_seqs rows; None when none does (the step runs eagerly)."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) and num_seqs > 0 else None


def is_decode_only(layout: StepLayout) -> bool:
    return len(layout.num_new) > 0 and bool((layout.num_new == 1).all())


@dataclass
class PaddedDecode:
    """A decode-only step's inputs, padded to `bucket` rows (host arrays)."""

    input_ids: np.ndarray  # [bucket] int64, 0 in padding rows
    positions: np.ndarray  # [bucket] int64, 0 in padding rows
    slots: np.ndarray  # [bucket] int32, -1 in padding rows: their K/V are not written
    context_lens: np.ndarray  # [bucket] int32, 0 in padding rows: they attend to nothing
    block_tables: np.ndarray  # [num_seqs, width] int32, the real rows only (padding rows are not read)


def pad_decode_step(layout: StepLayout, bucket: int) -> PaddedDecode:
    n = len(layout.num_new)
    if not is_decode_only(layout) or n > bucket:
        raise ValueError(f"pad_decode_step: needs a decode-only step of at most {bucket} requests")

    def padded(values, fill, dtype):
        out = np.full(bucket, fill, dtype=dtype)
        out[:n] = values
        return out

    width = -(-int(layout.ends.max()) // layout.block_size)
    return PaddedDecode(
        input_ids=padded(layout.input_ids, 0, np.int64),
        positions=padded(layout.positions, 0, np.int64),
        slots=padded(layout.slots, -1, np.int32),
        context_lens=padded(layout.ends, 0, np.int32),
        block_tables=np.ascontiguousarray(layout.tables[:, :width], dtype=np.int32),
    )


class StaticDecodeRunner:
    def __init__(self, model, kv_caches, *, block_size: int, max_model_len: int, max_batch: int,
                 num_kv_heads: int, num_sms: int, device: torch.device, capture: bool):
        from iterserve.kernels.triton_decode_attention import choose_num_splits

        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.sizes = capture_sizes(max_batch)
        self.capture = capture
        rows = self.sizes[-1]
        self.width = -(-max_model_len // block_size)
        ints: dict[str, Any] = dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.slots = torch.full((rows,), -1, **ints)
        self.context_lens = torch.zeros(rows, **ints)
        self.block_tables = torch.zeros((rows, self.width), **ints)
        self.token_index = torch.arange(rows, **ints)
        # contexts are unknown when a graph is captured: splits are sized for the longest one
        self.num_splits = {b: choose_num_splits(b, num_kv_heads, max_model_len, num_sms) for b in self.sizes}
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool: Any = None  # one memory pool shared by every bucket's graph (torch's handle)

    def can_run(self, layout: StepLayout) -> bool:
        return is_decode_only(layout) and len(layout.num_new) <= self.sizes[-1]

    def run(self, layout: StepLayout) -> torch.Tensor:
        """Hidden states [num_seqs, hidden] of a decode-only step (check can_run first)."""
        n = len(layout.num_new)
        bucket = bucket_for(n, self.sizes)
        assert bucket is not None  # can_run made sure one holds the step
        p = pad_decode_step(layout, bucket)
        for static, host in ((self.input_ids, p.input_ids), (self.positions, p.positions), (self.slots, p.slots),
                             (self.context_lens, p.context_lens)):
            static[:bucket].copy_(torch.from_numpy(host))
        self.block_tables[:n, :p.block_tables.shape[1]].copy_(torch.from_numpy(p.block_tables))
        if not self.capture:
            return self._forward(bucket)[:n]
        if bucket not in self.graphs:
            self._capture(bucket)
        graph, out = self.graphs[bucket]
        graph.replay()
        return out[:n]

    def _forward(self, bucket: int) -> torch.Tensor:
        meta = TritonAttentionMetadata(
            slot_mapping=self.slots[:bucket], block_size=self.block_size, prefill=None,
            decode=DecodeBatch(token_index=self.token_index[:bucket], block_tables=self.block_tables[:bucket],
                               context_lens=self.context_lens[:bucket], num_splits=self.num_splits[bucket]),
        )
        return self.model(self.input_ids[:bucket], self.positions[:bucket], self.kv_caches, meta)

    def _capture(self, bucket: int) -> None:
        # the eager run compiles every kernel for these shapes (no compiling inside a capture) and
        # computes this step; the replay that follows computes it again, writing the same K/V
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._forward(bucket)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self._forward(bucket)
        self.pool = graph.pool()
        self.graphs[bucket] = (graph, out)
