"""Per-step attention inputs, built once by the model runner and shared by every layer: the torch
path's (AttentionMetadata: index tensors and masks for gathers) and the Triton kernels' (flat tables).

The step's tokens are flattened: request r owns tokens [query_start[r], query_start[r] + num_query[r]),
at positions [context_len[r] - num_query[r], context_len[r]). Every request attends causally to its
whole context through its block table, so a fresh prefill, a chunk of a longer prompt, a recompute
after preemption and a decode differ only in these numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    # [num_tokens] cache slot (block_id * block_size + offset) each new token's K/V is written to
    slot_mapping: torch.Tensor
    block_size: int

    # Single-query requests (decodes, and prefill chunks of one token): one group for the C++ kernel,
    # which reads no padding; for the gather + SDPA path a few padded batches of similar context
    # length, so little of the gathered K/V is padding.
    single_groups: list[SingleQueryGroup]
    # Multi-query requests (prefill chunks): one by one on the gather + SDPA path, and all together
    # (`prefill`, the same requests as flat tables) in the C++ kernel when it serves
    multi: list[MultiQuery]
    prefill: PrefillBatch | None = None

    @property
    def decode_only(self) -> bool:
        """One single-query group holding every token of the step, in order (a decode step for the C++
        kernel): its queries need no gather and its outputs no scatter."""
        return not self.multi and len(self.single_groups) == 1 and self.single_groups[0].in_step_order


@dataclass
class SingleQueryGroup:
    token_index: torch.Tensor  # [n] index of each request's query token in the flattened step
    # [n, max_blocks] block table of each request, padded with block 0; K/V are gathered a whole block
    # at a time (one contiguous row per block is several times faster to copy than one per token)
    context_blocks: torch.Tensor
    # [n] tokens each query attends to, its own included: the CPU kernel walks only these, unpadded
    context_lens: torch.Tensor
    block_size: int
    in_step_order: bool = False  # token_index is 0..n-1: the group is the whole step, in order
    _mask: torch.Tensor | None = field(default=None, repr=False)

    @property
    def context_mask(self) -> torch.Tensor:
        """[n, 1, 1, max_blocks * block_size] True inside each request's context. Only the gather + SDPA
        path reads it: it is made on its first use in a step and shared by the layers, and never made
        when the C++ kernel serves."""
        if self._mask is None:
            width = self.context_blocks.shape[1] * self.block_size
            positions = torch.arange(width, device=self.context_lens.device)
            self._mask = (positions[None, :] < self.context_lens[:, None])[:, None, None, :]
        return self._mask


@dataclass
class MultiQuery:
    start: int  # index of its first query token in the flattened step
    num_query: int
    # [ceil(context_len / block_size)] the request's blocks; None when the chunk is the whole context (a
    # fresh prefill): its own K/V then serve directly, with a plain causal mask, without reading the
    # cache back
    context_blocks: torch.Tensor | None
    context_len: int = 0  # tokens before the chunk + the chunk
    _mask: torch.Tensor | None = field(default=None, repr=False)

    @property
    def mask(self) -> torch.Tensor | None:
        """[num_query, context_len] causal mask of a chunk after earlier context (None for a fresh
        prefill). Only the gather + SDPA path reads it: made on first use and shared by the layers."""
        if self.context_blocks is None:
            return None
        if self._mask is None:
            device = self.context_blocks.device
            first = self.context_len - self.num_query
            positions = torch.arange(first, self.context_len, device=device)
            self._mask = torch.arange(self.context_len, device=device)[None, :] <= positions[:, None]
        return self._mask


# -- the Triton backend's metadata: flat int32 tensors the kernels index directly --------------------

@dataclass
class DecodeBatch:
    """Single-query requests (decodes, and prefill chunks of one token)."""

    token_index: torch.Tensor  # [n] row of each request's query in the flattened step
    block_tables: torch.Tensor  # [n, width] block ids (padding columns are never read)
    context_lens: torch.Tensor  # [n] tokens each query attends to, its own included (0: a padding row)
    num_splits: int  # ranges each context is cut into (split-KV); 1 at large batches


@dataclass
class PrefillBatch:
    """Multi-query requests (prefill chunks of any length, with or without earlier context)."""

    query_start: torch.Tensor  # [m] row of each request's first query in the flattened step
    query_lens: torch.Tensor  # [m]
    context_lens: torch.Tensor  # [m] tokens before the chunk + the chunk
    block_tables: torch.Tensor  # [m, width]
    max_query_len: int


@dataclass
class TritonAttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] cache slot of each new token; -1 writes nothing
    block_size: int
    decode: DecodeBatch | None
    prefill: PrefillBatch | None
