"""Turn a SchedulerOutput into the flat tensors of one forward pass.

This runs on the CPU every step, so it loops over requests once in Python and does the per-position
work (positions, write slots, padded block tables, masks) vectorized in numpy. The layout of the step
(host arrays) is common to every backend; each backend builds only the device metadata it reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from iterserve.kernels import cpu_paged_attention
from iterserve.kernels.attention_metadata import AttentionMetadata, MultiQuery, PrefillBatch, SingleQueryGroup
from iterserve.server.engine.scheduler import ScheduledRequest, SchedulerOutput


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    meta: AttentionMetadata  # or the TritonAttentionMetadata of the Triton backend
    # index, in the flattened step, of the last token of each request the scheduler marked to sample:
    # it samples its next token from that position's logits
    sample_indices: torch.Tensor
    sampling: list[ScheduledRequest]


def padded_block_tables(tables: list[list[int]]) -> np.ndarray:
    """[len(tables), longest] block ids, zero-padded (block 0 is a valid index; masks hide it)."""
    lens = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
    total = int(lens.sum())
    padded = np.zeros((len(tables), max(int(lens.max()), 1)), dtype=np.int64)
    rows = np.repeat(np.arange(len(tables)), lens)
    cols = np.arange(total) - np.repeat(np.cumsum(lens) - lens, lens)
    padded[rows, cols] = np.fromiter(chain.from_iterable(tables), dtype=np.int64, count=total)
    return padded


# For the gather + SDPA path, single-query requests are split into at most this many groups of
# similar context length, and a group is never smaller than _MIN_GROUP: more groups cut padding but add
# per-layer op overhead. The C++ kernel reads no padding, so it gets them all in one group (one call a layer).
_MAX_GROUPS = 4
_MIN_GROUP = 16


def _groups_by_context(rows: np.ndarray, context_lens: np.ndarray, padded: bool) -> list[np.ndarray]:
    if len(rows) == 0:
        return []
    if not padded:
        return [rows]
    rows = rows[np.argsort(context_lens[rows], kind="stable")]
    num_groups = max(1, min(_MAX_GROUPS, len(rows) // _MIN_GROUP))
    return np.array_split(rows, num_groups)


@dataclass
class StepLayout:
    """One step in host (numpy) arrays, before any backend turns it into device tensors."""

    block_size: int
    input_ids: list[int]  # [num_tokens]
    positions: np.ndarray  # [num_tokens]
    slots: np.ndarray  # [num_tokens] cache slot of each new token
    starts: np.ndarray  # [num_reqs] index of each request's first token in the flattened step
    num_new: np.ndarray  # [num_reqs] tokens each request computes this step
    computed: np.ndarray  # [num_reqs] tokens each request had computed before
    ends: np.ndarray  # [num_reqs] context length after this step (computed + num_new)
    tables: np.ndarray  # [num_reqs, longest] block tables, zero-padded
    sample_indices: np.ndarray
    sampling: list[ScheduledRequest]  # the requests that sample, in sample_indices' order


def step_layout(out: SchedulerOutput, block_size: int) -> StepLayout:
    bs = block_size
    reqs = out.scheduled
    num_reqs = len(reqs)
    computed = np.fromiter((r.num_computed_tokens for r in reqs), dtype=np.int64, count=num_reqs)
    num_new = np.fromiter((len(r.new_token_ids) for r in reqs), dtype=np.int64, count=num_reqs)
    ends = computed + num_new
    starts = np.cumsum(num_new) - num_new  # first index of each request in the flattened step
    num_tokens = int(num_new.sum())

    # Positions and cache slots of every new token, vectorized over the flattened step.
    token_req = np.repeat(np.arange(num_reqs), num_new)
    positions = np.arange(num_tokens) - starts[token_req] + computed[token_req]
    tables = padded_block_tables([r.block_table for r in reqs])
    slots = tables[token_req, positions // bs] * bs + positions % bs
    input_ids = list(chain.from_iterable(r.new_token_ids for r in reqs))

    # The requests the scheduler marked sample a token from their last position.
    sampling = [i for i, r in enumerate(reqs) if r.sampling_params is not None]
    rows = np.asarray(sampling, dtype=np.int64)
    return StepLayout(
        block_size=bs, input_ids=input_ids, positions=positions, slots=slots, starts=starts, num_new=num_new,
        computed=computed, ends=ends, tables=tables, sample_indices=starts[rows] + num_new[rows] - 1,
        sampling=[reqs[i] for i in sampling],
    )


def build_torch_metadata(layout: StepLayout, device: torch.device) -> AttentionMetadata:
    """The torch path's metadata: single-query requests in padded groups, multi-query ones one by one."""
    bs, tables, ends, starts, num_new, computed = (
        layout.block_size, layout.tables, layout.ends, layout.starts, layout.num_new, layout.computed)
    single_groups = []
    padded = not (device.type == "cpu" and cpu_paged_attention.available())
    singles = np.flatnonzero(num_new == 1)
    for group in _groups_by_context(singles, ends, padded):
        ctx = ends[group]
        num_blocks = -(-int(ctx.max()) // bs)
        blocks = np.ascontiguousarray(tables[group, :num_blocks])
        single_groups.append(SingleQueryGroup(
            token_index=torch.from_numpy(starts[group]).to(device),
            context_blocks=torch.from_numpy(blocks).to(device),
            context_lens=torch.from_numpy(ctx).to(device),
            block_size=bs,
            in_step_order=len(group) == len(num_new) and not padded,  # one unsorted group of every request
        ))

    multi_queries = []
    multi = np.flatnonzero(num_new > 1)
    for i in multi.tolist():
        start, n, c = int(starts[i]), int(num_new[i]), int(computed[i])
        context_blocks = (None if c == 0
                          else torch.from_numpy(np.ascontiguousarray(tables[i, : -(-(c + n) // bs)])).to(device))
        multi_queries.append(MultiQuery(start, n, context_blocks, c + n))
    prefill = None
    if len(multi) and not padded:  # the C++ kernel serves: every multi-query request in one call
        width = -(-int(ends[multi].max()) // bs)
        prefill = PrefillBatch(
            query_start=torch.from_numpy(starts[multi]).to(device),
            query_lens=torch.from_numpy(num_new[multi]).to(device),
            context_lens=torch.from_numpy(ends[multi]).to(device),
            block_tables=torch.from_numpy(np.ascontiguousarray(tables[multi, :width])).to(device),
            max_query_len=int(num_new[multi].max()),
        )
    return AttentionMetadata(
        slot_mapping=torch.from_numpy(layout.slots).to(device),
        block_size=bs,
        single_groups=single_groups,
        multi=multi_queries,
        prefill=prefill,
    )


def to_step_inputs(layout: StepLayout, device: torch.device, build_metadata=build_torch_metadata) -> StepInputs:
    return StepInputs(
        input_ids=torch.tensor(layout.input_ids, dtype=torch.long, device=device),
        positions=torch.from_numpy(layout.positions).to(device),
        meta=build_metadata(layout, device),
        sample_indices=torch.from_numpy(layout.sample_indices).to(device),
        sampling=layout.sampling,
    )


def prepare_step_inputs(out: SchedulerOutput, block_size: int, device: torch.device,
                        build_metadata=build_torch_metadata) -> StepInputs:
    return to_step_inputs(step_layout(out, block_size), device, build_metadata)
