"""A model runner without a model: it prepares each step's inputs exactly like ModelRunner, then
returns deterministic tokens instead of running a forward pass.

It measures what the engine costs around the model (scheduling, input preparation, bookkeeping) and
drives the property tests of the scheduler at thousands of steps per second.
"""

from __future__ import annotations

import torch

from iterserve.server.engine.scheduler import SchedulerOutput
from iterserve.server.runner.sampler import SamplerOutput
from iterserve.server.runner.step_inputs import prepare_step_inputs


class NullModelRunner:
    def __init__(self, block_size: int, vocab_size: int = 1000, prepare_inputs: bool = True):
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.prepare_inputs = prepare_inputs
        self.device = torch.device("cpu")

    def execute_model(self, out: SchedulerOutput) -> SamplerOutput:
        if self.prepare_inputs:
            inputs = prepare_step_inputs(out, self.block_size, self.device)
            requests = inputs.sampling_requests
        else:
            requests = [r for r, n in zip(out.scheduled_requests, out.num_scheduled_tokens)
                        if r.num_computed_tokens + n == r.num_tokens]
        # the next token depends only on the request's own tokens, as a real model's would
        tokens = [(r.num_tokens * 31 + r.token_ids[-1]) % self.vocab_size for r in requests]
        return SamplerOutput(tokens, [None] * len(tokens), [None] * len(tokens))
