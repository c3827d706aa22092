"""What changes a request's logits before its token is chosen, in vLLM's order: repetition, frequency and
presence penalties over its tokens so far, then `logit_bias`, then the ban on EOS and stop tokens until
`min_tokens` were generated. Only the rows of requests that ask for any of it are touched, on a copy:
the raw logits stay what logprobs report (as vLLM's default), and a batch without processing pays nothing.
`min_p` belongs to the random draw and lives in the sampler. Last, the grammar masks of structured output:
one bitmask for the whole batch, applied to the rows that have a grammar (a batch without any skips it)."""

from __future__ import annotations

import torch

from iterserve.server.engine.grammar_manager import GrammarBitmask
from iterserve.server.engine.scheduler import ScheduledRequest


def process_logits(logits: torch.Tensor, sampling: list[ScheduledRequest], eos_token_ids: frozenset[int]
                   ) -> torch.Tensor:
    """logits: [len(sampling), vocab] float32 -> the logits to choose from (the same tensor when no row
    needs processing)."""
    rows = [(i, s, s.token_ids) for i, s in enumerate(sampling) if s.token_ids is not None]
    if not rows:
        return logits
    out = logits.clone()
    for i, s, token_ids in rows:
        out[i] = process_row(out[i], s.sampling_params, token_ids, s.num_prompt_tokens, eos_token_ids)
    return out


def process_row(row: torch.Tensor, p, token_ids: list[int], num_prompt_tokens: int,
                eos_token_ids: frozenset[int]) -> torch.Tensor:
    vocab = row.shape[-1]
    outputs = token_ids[num_prompt_tokens:]
    if p.repetition_penalty != 1.0 and token_ids:
        # as HF's RepetitionPenaltyLogitsProcessor and vLLM: every token seen, prompt included
        seen = torch.tensor(sorted(set(token_ids)), dtype=torch.long, device=row.device)
        values = row[seen]
        row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and outputs:
        counts = torch.bincount(torch.tensor(outputs, dtype=torch.long, device=row.device), minlength=vocab)
        counts = counts[:vocab].to(row.dtype)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=row.device)
        row[ids] += torch.tensor(list(p.logit_bias.values()), dtype=row.dtype, device=row.device)
    if len(outputs) < p.min_tokens:
        banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
        banned_ids = sorted(t for t in banned if t < vocab)
        if banned_ids:
            row[torch.tensor(banned_ids, dtype=torch.long, device=row.device)] = float("-inf")
    return row


def apply_grammar_bitmask(logits: torch.Tensor, raw_logits: torch.Tensor, sampling: list[ScheduledRequest],
                          grammar: GrammarBitmask) -> torch.Tensor:
    """Set to -inf every token a row's grammar does not allow, in the rows of `grammar.request_ids`, in place
    (xgrammar's kernel: C++ on CPU, Triton on CUDA); on a copy only when the logits are the raw ones and a
    row reports logprobs, which come from them. The masks were filled while the model ran: this is where
    the step waits for them."""
    import xgrammar

    row_of = {s.request_id: i for i, s in enumerate(sampling)}
    rows = [row_of[r] for r in grammar.request_ids]
    if logits is raw_logits and any(s.sampling_params and s.sampling_params.logprobs for s in sampling):
        logits = logits.clone()
    masks = grammar.result()
    full = torch.full((logits.shape[0], masks.shape[1]), -1, dtype=torch.int32)  # -1: all allowed
    full[rows] = masks
    xgrammar.apply_token_bitmask_inplace(logits, full.to(logits.device, non_blocking=True), indices=rows,
                                         vocab_size=logits.shape[-1])
    return logits
