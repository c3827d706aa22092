"""The Triton backend as the model sees it: paged attention over TritonAttentionMetadata and the fused
layer ops, with the same signatures as the torch path (kernels/paged_attention_torch.py and
TorchLayerOps in server/model/llama.py)."""

from __future__ import annotations

import torch

from iterserve.kernels.attention_metadata import TritonAttentionMetadata
from iterserve.kernels.triton_decode_attention import decode_attention_triton
from iterserve.kernels.triton_kv_write import write_kv_triton
from iterserve.kernels.triton_layer_ops import add_rms_norm_triton, rotary_triton, silu_mul_triton
from iterserve.kernels.triton_prefill_attention import prefill_attention_triton


def triton_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, meta: TritonAttentionMetadata, scale: float) -> torch.Tensor:
    """Write k, v into the cache, then attend every query row through the block tables."""
    write_kv_triton(k, v, k_cache, v_cache, meta.slot_mapping)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # every row is written by one kernel
    if meta.decode is not None:
        d = meta.decode
        decode_attention_triton(q, k_cache, v_cache, out, d.token_index, d.block_tables, d.context_lens,
                                meta.block_size, scale, num_splits=d.num_splits)
    if meta.prefill is not None:
        p = meta.prefill
        prefill_attention_triton(q, k_cache, v_cache, out, p.query_start, p.query_lens, p.context_lens,
                                 p.block_tables, p.max_query_len, meta.block_size, scale)
    return out


class TritonLayerOps:
    """Fused residual add + RMSNorm, in-place rotary embedding and SwiGLU."""

    @staticmethod
    def add_rms_norm(norm, x: torch.Tensor, residual: torch.Tensor | None):
        return add_rms_norm_triton(x, residual, norm.weight, norm.eps)

    @staticmethod
    def rotary(rope, positions: torch.Tensor, qk: torch.Tensor) -> torch.Tensor:
        return rotary_triton(qk, positions, rope.cos_cache, rope.sin_cache)

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        return silu_mul_triton(gate_up)
