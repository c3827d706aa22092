"""Penalties, logit_bias, min_tokens and min_p: each changes the logits exactly as its definition says
(checked against a plain reference written here), greedy outputs with a repetition penalty equal HF
transformers' `generate(repetition_penalty=...)` token for token under batching, chunking and preemption,
requests without processing are untouched by their neighbours', and the API takes the fields as vLLM
and OpenAI spell them."""

from __future__ import annotations

import math

import httpx
import openai
import pytest
import torch

from iterserve.server.engine.sampling_params import SamplingParams
from iterserve.server.errors import InvalidRequestError
from iterserve.server.runner.logits_processors import process_row
from iterserve.server.runner.sampler import _sample_row
from tests.conftest import make_engine
from tests.server_support import InProcessServer
from tests.test_engine_vs_hf import workload

VOCAB = 12


def reference(logits: list[float], p: SamplingParams, tokens: list[int], num_prompt: int, eos: set[int]):
    """The definitions, one token at a time."""
    out = list(logits)
    outputs = tokens[num_prompt:]
    for t in set(tokens):
        out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t in range(len(out)):
        count = outputs.count(t)
        out[t] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    for t, bias in p.logit_bias.items():
        out[t] += bias
    if len(outputs) < p.min_tokens:
        for t in set(p.stop_token_ids) | (set() if p.ignore_eos else eos):
            out[t] = -math.inf
    return out


@pytest.mark.parametrize("params", [
    dict(repetition_penalty=1.3),
    dict(repetition_penalty=0.7),
    dict(frequency_penalty=0.5),
    dict(presence_penalty=-1.5),
    dict(frequency_penalty=1.0, presence_penalty=0.25, repetition_penalty=1.2),
    dict(logit_bias={3: 5.0, 7: -100.0}),
    dict(min_tokens=5, stop_token_ids=[2]),
    dict(min_tokens=5, stop_token_ids=[2], ignore_eos=True),
    dict(min_tokens=3),  # already past it: nothing banned
])
def test_each_processor_follows_its_definition(params):
    torch.manual_seed(0)
    logits = torch.randn(VOCAB) * 3
    p = SamplingParams(max_tokens=8, **params)
    tokens = [1, 4, 4, 9, 3, 3, 3, 0]  # 4 prompt tokens, then 4 outputs
    got = process_row(logits.clone(), p, tokens, 4, frozenset({11}))
    want = reference(logits.tolist(), p, tokens, 4, {11})
    assert got.tolist() == pytest.approx(want, rel=1e-6, abs=1e-6)


def test_min_p_keeps_only_tokens_near_the_most_probable():
    row = torch.log(torch.tensor([0.5, 0.3, 0.1, 0.06, 0.04]))
    p = SamplingParams(temperature=1.0, min_p=0.25, seed=1)  # keeps p >= 0.125: tokens 0 and 1
    drawn = {_sample_row(row, p, torch.Generator().manual_seed(s)) for s in range(200)}
    assert drawn == {0, 1}


@pytest.mark.parametrize("name, value", [("frequency_penalty", 2.5), ("presence_penalty", -3),
                                         ("repetition_penalty", 0), ("min_p", 1.5), ("min_tokens", -1),
                                         ("logit_bias", {1: 101.0})])
def test_out_of_range_values_name_their_field(name, value):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**{name: value})
    assert e.value.param == name
    with pytest.raises(InvalidRequestError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


def run(engine, requests):
    ids = [engine.add_request(prompt_token_ids=prompt, sampling_params=params) for prompt, params in requests]
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return [done[i].token_ids for i in ids]


def hf_repetition(model, prompt: list[int], max_tokens: int, penalty: float) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                             repetition_penalty=penalty, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("options", [dict(max_num_seqs=16), dict(prefill_chunk_size=7, max_num_batched_tokens=16),
                                     dict(kv_cache_memory=24 * 16 * 512, max_model_len=128, max_num_seqs=12)])
def test_repetition_penalty_matches_hf_generate_in_a_mixed_batch(tiny_llama, options):
    """Half the requests carry a penalty, half do not: each half matches its own HF reference."""
    path, model = tiny_llama
    items = workload(12, seed=7, max_prompt=40, max_out=60)
    penalty = [1.3 if i % 2 else 1.0 for i in range(len(items))]
    requests = [(prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, repetition_penalty=rp))
                for (prompt, n), rp in zip(items, penalty, strict=True)]
    engine = make_engine(path, **options)
    outputs = run(engine, requests)
    for (prompt, n), rp, got in zip(items, penalty, outputs, strict=True):
        assert got == hf_repetition(model, prompt, n, rp), f"repetition_penalty {rp}"


def test_frequency_and_presence_penalties_match_a_step_by_step_reference(tiny_llama):
    path, model = tiny_llama
    prompt, n = [5, 9, 9, 14, 3], 30
    p = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, frequency_penalty=0.8, presence_penalty=0.4)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1].tolist()
            adjusted = reference(logits, p, ids, len(prompt), set())
            ids.append(max(range(len(adjusted)), key=adjusted.__getitem__))
    (got,) = run(make_engine(path), [(prompt, p)])
    assert got == ids[len(prompt):]


def test_logit_bias_and_min_tokens_steer_greedy_decoding(tiny_llama):
    path, _ = tiny_llama
    plain = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    (free,) = run(make_engine(path), [([7, 8, 9], plain)])
    stop = free[1]  # a token greedy decoding reaches early
    biased = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logit_bias={42: 100.0})
    held = SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop], min_tokens=5)
    early = SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop])
    forced, late, stopped = run(make_engine(path), [([7, 8, 9], biased), ([7, 8, 9], held), ([7, 8, 9], early)])
    assert forced == [42] * 6
    assert len(stopped) <= 2 and stop not in late[:5] and len(late) > 5


def test_the_api_takes_the_fields_as_openai_and_vllm_spell_them(tiny_dir):
    with InProcessServer(tiny_dir, model_name="m") as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        r = client.completions.create(model="m", prompt=[5, 6, 7], max_tokens=4, temperature=0,
                                      logit_bias={"42": 100}, frequency_penalty=0.5, presence_penalty=0.5,
                                      extra_body={"repetition_penalty": 1.1, "min_tokens": 2, "min_p": 0.1,
                                                  "ignore_eos": True})
        assert r.choices[0].text and r.usage.completion_tokens == 4
        ids = httpx.post(srv.url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0,
                                                             "logit_bias": {"42": 100}}).json()
        assert ids["usage"]["completion_tokens"] == 4
        for body, param in [({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": {"100000": 1}}, "logit_bias"),
                            ({"frequency_penalty": 3}, "frequency_penalty"), ({"min_tokens": 9}, "min_tokens")]:
            bad = httpx.post(srv.url + "/v1/completions", json={"prompt": [5], "max_tokens": 4, **body})
            assert bad.status_code == 400 and param in bad.text, bad.text
