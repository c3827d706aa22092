"""Choose each request's next token from its logits: greedy, or temperature / top-k / top-p sampling.

Every row is processed on its own (no cross-row normalisation), and a seeded request draws from its
own torch.Generator, so its tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from iterserve.server.engine.request import Request


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per sampling request, in order
    logprobs: list[float | None]  # logprob of the chosen token under the model's raw distribution
    # the top_logprobs most likely (token id, logprob) pairs, best first, where asked for
    top_logprobs: list[list[tuple[int, float]] | None]


def sample(logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
    """logits: [len(requests), vocab] float32."""
    params = [r.sampling_params for r in requests]
    token_ids = logits.max(dim=-1).indices  # argmax's answer (the first maximum) at half its time on CPU
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows:
        token_ids = token_ids.clone()
        for i in random_rows:
            # on the CPU: a seeded request's generator lives there, and one row is cheap to move
            token_ids[i] = _sample_row(logits[i].cpu(), requests[i])
    chosen = token_ids.tolist()

    logprobs: list[float | None] = [None] * len(requests)
    top: list[list[tuple[int, float]] | None] = [None] * len(requests)
    wanted = [i for i, p in enumerate(params) if p.logprobs]
    if wanted:
        rows = torch.tensor(wanted)
        all_lp = torch.log_softmax(logits[rows], dim=-1)
        lp = all_lp.gather(1, token_ids[rows].unsqueeze(1)).squeeze(1)
        for i, value in zip(wanted, lp.tolist()):
            logprobs[i] = value
        k = max(params[i].top_logprobs for i in wanted)
        if k:
            values, ids = all_lp.topk(k, dim=-1)
            for row, i in enumerate(wanted):
                n = params[i].top_logprobs
                top[i] = list(zip(ids[row, :n].tolist(), values[row, :n].tolist())) if n else None
    return SamplerOutput(chosen, logprobs, top)


def _sample_row(row: torch.Tensor, req: Request) -> int:
    p = req.sampling_params
    row = row / p.temperature
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
    return int(torch.multinomial(probs, 1, generator=_generator(req)).item())


def _generator(req: Request) -> torch.Generator | None:
    seed = req.sampling_params.seed
    if seed is None:
        return None  # the global RNG, seeded once by the engine
    if req.sampling_generator is None:
        req.sampling_generator = torch.Generator(device="cpu")
        req.sampling_generator.manual_seed(seed)
    return req.sampling_generator
