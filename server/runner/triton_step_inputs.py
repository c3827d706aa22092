"""The Triton backend's metadata from a StepLayout: flat int32 tables sent to the device in one copy.

Single-query requests go to the decode kernel, multi-query ones to the prefill kernel; each kernel
reads and writes its own rows of the step, so no gather or scatter is needed around them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from iterserve.kernels.attention_metadata import DecodeBatch, PrefillBatch, TritonAttentionMetadata
from iterserve.kernels.triton_decode_attention import choose_num_splits
from iterserve.server.runner.step_inputs import StepLayout


def _pack(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Views of one int32 device tensor holding every array: a single host-to-device copy per step.
    Each view starts 16 bytes aligned, as fresh tensors do: Triton compiles a kernel variant per
    pointer alignment, and misaligned views would cost a compile in the middle of serving."""
    offsets, total = [], 0
    for a in arrays:
        offsets.append(total)
        total += -(-a.size // 4) * 4
    flat = np.zeros(total, dtype=np.int32)
    for a, offset in zip(arrays, offsets, strict=True):
        flat[offset:offset + a.size] = a.ravel()
    packed = torch.from_numpy(flat).to(device)
    return [packed[offset:offset + a.size].view(a.shape) for a, offset in zip(arrays, offsets, strict=True)]


@dataclass
class TritonMetadataBuilder:
    num_kv_heads: int
    num_sms: int  # streaming multiprocessors of the GPU: how many programs fill it (1 on CPU)

    def __call__(self, layout: StepLayout, device: torch.device) -> TritonAttentionMetadata:
        bs, tables, ends = layout.block_size, layout.tables, layout.ends
        single = np.flatnonzero(layout.num_new == 1)
        multi = np.flatnonzero(layout.num_new > 1)
        arrays = [layout.slots]
        if len(single):
            width = -(-int(ends[single].max()) // bs)
            arrays += [layout.starts[single], tables[single, :width], ends[single]]
        if len(multi):
            width = -(-int(ends[multi].max()) // bs)
            arrays += [layout.starts[multi], layout.num_new[multi], ends[multi], tables[multi, :width]]
        views = _pack(arrays, device)
        decode = prefill = None
        if len(single):
            splits = choose_num_splits(len(single), self.num_kv_heads, int(ends[single].max()), self.num_sms)
            decode = DecodeBatch(token_index=views[1], block_tables=views[2], context_lens=views[3],
                                 num_splits=splits)
        if len(multi):
            prefill = PrefillBatch(query_start=views[-4], query_lens=views[-3], context_lens=views[-2],
                                   block_tables=views[-1], max_query_len=int(layout.num_new[multi].max()))
        return TritonAttentionMetadata(slot_mapping=views[0], block_size=bs, decode=decode, prefill=prefill)
