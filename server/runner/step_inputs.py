"""Turn a SchedulerOutput into the flat tensors of one forward pass.

This runs on the CPU every step, so it loops over requests once in Python and does the per-position
work (context slot tables, masks) vectorized in numpy.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from iterserve.kernels.attention_metadata import AttentionMetadata, MultiQuery
from iterserve.server.engine.request import Request
from iterserve.server.engine.scheduler import SchedulerOutput


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    meta: AttentionMetadata
    # index, in the flattened step, of the last token of each request whose computed tokens reach its
    # total this step: those requests sample their next token from that position's logits
    sample_indices: torch.Tensor
    sampling_requests: list[Request]


def context_slots(tables: list[list[int]], context_lens: np.ndarray, block_size: int) -> np.ndarray:
    """[len(tables), max(context_lens)] cache slot of each context position; past the end: slot of block 0."""
    lens = np.fromiter((len(t) for t in tables), dtype=np.int64, count=len(tables))
    padded = np.zeros((len(tables), max(int(lens.max()), 1)), dtype=np.int64)
    rows = np.repeat(np.arange(len(tables)), lens)
    cols = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)
    padded[rows, cols] = np.fromiter(chain.from_iterable(tables), dtype=np.int64, count=int(lens.sum()))
    pos = np.arange(int(context_lens.max()))
    return padded[:, pos // block_size] * block_size + pos % block_size


def prepare_step_inputs(out: SchedulerOutput, block_size: int, device: torch.device) -> StepInputs:
    bs = block_size
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    single_index: list[int] = []
    single_tables: list[list[int]] = []
    single_context: list[int] = []
    multi: list[tuple[int, int, int, list[int]]] = []  # (start, num_query, num_computed, table)
    sample_indices: list[int] = []
    sampling_requests: list[Request] = []

    t = 0
    for req, n, table in zip(out.scheduled_requests, out.num_scheduled_tokens, out.block_tables):
        c = req.num_computed_tokens
        end = c + n
        if n == 1:
            input_ids.append(req.token_ids[c])
            positions.append(c)
            slots.append(table[c // bs] * bs + c % bs)
            single_index.append(t)
            single_tables.append(table)
            single_context.append(end)
        else:
            input_ids.extend(req.token_ids[c:end])
            positions.extend(range(c, end))
            slots.extend([table[p // bs] * bs + p % bs for p in range(c, end)])
            multi.append((t, n, c, table))
        t += n
        if end == req.num_tokens:
            sample_indices.append(t - 1)
            sampling_requests.append(req)

    single_slots = single_mask = single_idx = None
    if single_index:
        ctx = np.asarray(single_context, dtype=np.int64)
        single_slots = torch.from_numpy(context_slots(single_tables, ctx, bs)).to(device)
        mask = np.arange(single_slots.shape[1])[None, :] < ctx[:, None]
        single_mask = torch.from_numpy(mask).to(device)[:, None, None, :]
        single_idx = torch.tensor(single_index, dtype=torch.long, device=device)

    multi_queries = []
    for start, n, c, table in multi:
        if c == 0:
            multi_queries.append(MultiQuery(start, n, None, None))
            continue
        ctx = c + n
        ctx_slots = context_slots([table], np.asarray([ctx]), bs)[0]
        mask = np.arange(ctx)[None, :] <= (c + np.arange(n))[:, None]
        multi_queries.append(
            MultiQuery(start, n, torch.from_numpy(ctx_slots).to(device), torch.from_numpy(mask).to(device))
        )

    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        block_size=bs,
        single_token_index=single_idx,
        single_context_slots=single_slots,
        single_context_mask=single_mask,
        multi=multi_queries,
    )
    return StepInputs(
        input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        meta=meta,
        sample_indices=torch.tensor(sample_indices, dtype=torch.long, device=device),
        sampling_requests=sampling_requests,
    )
