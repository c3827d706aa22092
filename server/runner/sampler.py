"""Choose each request's next token from its logits: greedy, or temperature / top-k / top-p sampling.

Every row is processed on its own (no cross-row normalisation), and a seeded request draws from its
own torch.Generator (kept by the model runner, by request id), so its tokens do not depend on what
else is in the batch. Results are keyed by request id.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from iterserve.kernels.cpu_layer_ops import first_max
from iterserve.server.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from iterserve.server.engine.scheduler import ScheduledRequest


@dataclass
class ModelRunnerOutput:
    """One step's sampled tokens, by request id (only the requests the scheduler marked to sample)."""

    token_ids: dict[str, int]
    logprobs: dict[str, float]  # the chosen token's logprob under the raw distribution, where asked for
    # the top_logprobs most likely (token id, logprob) pairs, best first, where asked for
    top_logprobs: dict[str, list[tuple[int, float]]]


EMPTY_OUTPUT = ModelRunnerOutput({}, {}, {})


def sample(logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams],
           generators: dict[str, torch.Generator], raw_logits: torch.Tensor | None = None) -> ModelRunnerOutput:
    """logits: [len(request_ids), vocab] float32, processed (logits_processors.py); `raw_logits`: the
    model's own, which logprobs report (default: `logits`). `generators` holds the seeded requests'
    generators (created here at their first random draw; the caller drops them when a request leaves)."""
    token_ids = first_max(logits)  # argmax's answer (the first maximum), a C++ pass on CPU
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows:
        token_ids = token_ids.clone()
        for i in random_rows:
            # on the CPU: a seeded request's generator lives there, and one row is cheap to move
            token_ids[i] = _sample_row(logits[i].cpu(), params[i], _generator(request_ids[i], params[i], generators))
    chosen = token_ids.tolist()

    logprobs: dict[str, float] = {}
    top: dict[str, list[tuple[int, float]]] = {}
    wanted = [i for i, p in enumerate(params) if p.logprobs]
    if wanted:
        rows = torch.tensor(wanted)
        all_lp = torch.log_softmax((logits if raw_logits is None else raw_logits)[rows], dim=-1)
        lp = all_lp.gather(1, token_ids[rows].unsqueeze(1)).squeeze(1)
        for i, value in zip(wanted, lp.tolist(), strict=True):
            logprobs[request_ids[i]] = value
        k = max(params[i].top_logprobs for i in wanted)
        if k:
            values, ids = all_lp.topk(k, dim=-1)
            for row, i in enumerate(wanted):
                n = params[i].top_logprobs
                if n:
                    top[request_ids[i]] = list(zip(ids[row, :n].tolist(), values[row, :n].tolist(), strict=True))
    return ModelRunnerOutput(dict(zip(request_ids, chosen, strict=True)), logprobs, top)


def takes_argmax(sampling: list[ScheduledRequest]) -> bool:
    """Whether every row's token is the argmax of the model's own logits: greedy, no logprobs, and nothing
    that changes logits (penalties, bias, min_tokens: rows that need them carry their tokens)."""
    return all(s.token_ids is None and s.sampling_params is not None and s.sampling_params.greedy
               and not s.sampling_params.logprobs for s in sampling)


def greedy_output(logits: torch.Tensor, sampling: list[ScheduledRequest]) -> ModelRunnerOutput:
    """The argmax of each row of `logits` (any float dtype: the first maximum, as `sample` takes it)."""
    chosen = first_max(logits).tolist()
    return ModelRunnerOutput(dict(zip((s.request_id for s in sampling), chosen, strict=True)), {}, {})


def _sample_row(row: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
    row = row / p.temperature
    if p.min_p > 0:
        # after the temperature, before top-k/top-p, as vLLM: relative to the most probable token
        probs = row.softmax(-1)
        row = row.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    if 0 < p.top_k < row.shape[-1]:
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(row, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # drop a token when the tokens ranked before it already cover top_p; the first always stays, even for
        # a top_p that float32 rounds to 0 (a subnormal like 2e-309 passes the (0, 1] check)
        drop_sorted = (cumulative - sorted_logits.softmax(-1)) >= p.top_p
        drop_sorted[0] = False
        row = row.masked_fill(torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted), float("-inf"))
    probs = row.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())


def _generator(request_id: str, p: SamplingParams, generators: dict[str, torch.Generator]
               ) -> torch.Generator | None:
    if p.seed is None:
        return None  # the global RNG, seeded once by the engine
    generator = generators.get(request_id)
    if generator is None:
        generator = generators[request_id] = torch.Generator(device="cpu")
        generator.manual_seed(p.seed)
    return generator
