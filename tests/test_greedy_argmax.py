"""Plain greedy rows take the argmax of the model's own logits, without a float32 copy of them: the rows
that take that path are exactly those the sampler would answer with the argmax, and the tokens are the
sampler's, ties included, in bf16 where the copy is skipped."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from iterserve.server.engine.sampling_params import SamplingParams
from iterserve.server.engine.scheduler import ScheduledRequest
from iterserve.server.runner import model_runner
from iterserve.server.runner.sampler import greedy_output, sample, takes_argmax
from tests.conftest import make_engine


def row(request_id: str, history: list[int] | None = None, **params) -> ScheduledRequest:
    return ScheduledRequest(request_id, [1], 0, [0], SamplingParams(**params), history, 0)


@pytest.mark.parametrize(("rows", "expected"), [
    ([row("a", temperature=0), row("b", temperature=0, max_tokens=3)], True),
    ([row("a", temperature=0), row("b", temperature=0.7)], False),  # one row draws at random
    ([row("a", temperature=0, logprobs=1)], False),  # logprobs come from the float32 logits
    ([row("a", [5, 6], temperature=0, repetition_penalty=1.2)], False),  # processed rows carry their tokens
    ([], True),
])
def test_only_plain_greedy_batches_take_the_argmax(rows, expected):
    assert takes_argmax(rows) is expected


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.sampled_from([-3.0, -0.5, 0.0, 1.25, 1.2578125, 7.0]), min_size=8, max_size=8),
                min_size=1, max_size=6))
def test_the_argmax_of_bf16_logits_is_the_samplers_token(values):
    # few distinct values: ties are frequent, and both must pick the first maximum
    logits = torch.tensor(values, dtype=torch.bfloat16)
    rows = [row(f"r{i}", temperature=0) for i in range(len(values))]
    ids = [r.request_id for r in rows]
    expected = sample(logits.float(), ids, [r.sampling_params for r in rows], {})
    assert greedy_output(logits, rows).token_ids == expected.token_ids


def run_greedy(path: str, prompts: list[list[int]]) -> list[list[int]]:
    engine = make_engine(path, dtype="bfloat16", max_model_len=64, kv_cache_memory="16MiB",
                         max_num_batched_tokens=24, prefill_chunk_size=16)  # batches, chunks
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    ids = [engine.add_request(prompt_token_ids=p, sampling_params=params) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    return [done[i] for i in ids]


def test_bf16_greedy_tokens_are_those_of_the_float32_path(tiny_llama, monkeypatch):
    path, _ = tiny_llama
    prompts = [[(7 * i + j) % 90 + 3 for j in range(5 + 3 * i)] for i in range(6)]
    calls = []
    real = model_runner.greedy_output
    monkeypatch.setattr(model_runner, "greedy_output", lambda *a: calls.append(1) or real(*a))
    fast = run_greedy(path, prompts)
    assert calls, "the plain greedy batch did not take the argmax path"
    monkeypatch.setattr(model_runner, "takes_argmax", lambda sampling: False)
    assert run_greedy(path, prompts) == fast
