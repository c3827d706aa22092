"""A model runner without a model: it prepares each step's inputs exactly like ModelRunner, then
returns deterministic tokens instead of running a forward pass.

It measures what the engine costs around the model (scheduling, input preparation, bookkeeping) and
drives the property tests of the scheduler at thousands of steps per second.
"""

from __future__ import annotations

import torch

from iterserve.server.engine.scheduler import SchedulerOutput
from iterserve.server.runner.sampler import ModelRunnerOutput
from iterserve.server.runner.step_inputs import prepare_step_inputs


class NullModelRunner:
    def __init__(self, block_size: int, vocab_size: int = 1000, prepare_inputs: bool = True):
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.prepare_inputs = prepare_inputs
        self.device = torch.device("cpu")

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        if self.prepare_inputs and not out.is_empty:
            sampling = prepare_step_inputs(out, self.block_size, self.device).sampling
        else:
            sampling = [s for s in out.scheduled if s.sampling_params is not None]
        # the next token depends only on the request's own tokens, as a real model's would: its length
        # (the position after its last token) and its last token
        tokens = {s.request_id: ((s.num_computed_tokens + len(s.new_token_ids)) * 31 + s.new_token_ids[-1])
                  % self.vocab_size for s in sampling}
        return ModelRunnerOutput(tokens, {}, {})
