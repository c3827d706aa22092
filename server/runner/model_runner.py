"""Runs one step's forward pass over the paged KV cache and samples the next tokens."""

from __future__ import annotations

import torch

from iterserve.kernels.paged_attention_torch import paged_attention
from iterserve.server.engine.scheduler import SchedulerOutput
from iterserve.server.model.llama import LlamaForCausalLM
from iterserve.server.model.model_config import ModelConfig
from iterserve.server.runner.sampler import SamplerOutput, sample
from iterserve.server.runner.step_inputs import prepare_step_inputs


class ModelRunner:
    def __init__(self, model_config: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device,
                 dtype: torch.dtype, max_model_len: int, block_size: int, attention_fn=paged_attention):
        self.model_config = model_config
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        # Built on the meta device so no time goes into random init; weights are copied in after.
        with torch.device("meta"):
            model = LlamaForCausalLM(model_config, attention_fn, max_model_len)
        model = model.to_empty(device=device)
        model.rope.build_cache()
        model.load_weights(weights)
        self.model = model.to(dtype).eval()
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []

    def kv_cache_bytes_per_block(self) -> int:
        cfg = self.model_config
        per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim
        return per_token * self.block_size * torch.empty((), dtype=self.dtype).element_size()

    def allocate_kv_cache(self, num_blocks: int) -> None:
        cfg = self.model_config
        shape = (num_blocks * self.block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.dtype, device=self.device),
             torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(cfg.num_hidden_layers)
        ]

    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> SamplerOutput:
        inputs = prepare_step_inputs(out, self.block_size, self.device)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        if not inputs.sampling_requests:
            return SamplerOutput([], [], [])
        logits = self.model.compute_logits(hidden.index_select(0, inputs.sample_indices))
        return sample(logits, inputs.sampling_requests)
