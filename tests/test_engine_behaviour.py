"""Sampling, stopping, aborts and bad input on the engine and the offline LLM entry."""

from __future__ import annotations

import pytest

from iterserve.server.config import EngineConfig
from iterserve.server.engine.sampling_params import SamplingParams
from iterserve.server.entrypoints.llm import LLM
from iterserve.server.errors import InvalidRequestError
from tests.conftest import make_engine


def drain(engine):
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def test_seeded_sampling_ignores_batch_composition(tiny_llama):
    path, _ = tiny_llama
    params = SamplingParams(max_tokens=20, temperature=0.9, top_k=50, top_p=0.9, seed=1234, ignore_eos=True)
    alone = make_engine(path)
    rid = alone.add_request(prompt_token_ids=[5, 6, 7], sampling_params=params)
    solo_tokens = drain(alone)[rid][-1].token_ids

    crowded = make_engine(path, max_num_seqs=8, prefill_chunk_size=2)
    others = [crowded.add_request(prompt_token_ids=[9] * (i + 1), sampling_params=SamplingParams(
        max_tokens=15, temperature=1.0, ignore_eos=True)) for i in range(5)]
    rid = crowded.add_request(prompt_token_ids=[5, 6, 7], sampling_params=params)
    outs = drain(crowded)
    assert outs[rid][-1].token_ids == solo_tokens
    assert all(outs[o][-1].finished for o in others)
    # a different seed gives a different sequence (20 tokens over a 320-token vocabulary)
    other = make_engine(path)
    rid = other.add_request(prompt_token_ids=[5, 6, 7], sampling_params=SamplingParams(
        max_tokens=20, temperature=0.9, top_k=50, top_p=0.9, seed=99, ignore_eos=True))
    assert drain(other)[rid][-1].token_ids != solo_tokens


def test_top_k_one_is_greedy_and_logprobs_are_reported(tiny_llama):
    path, _ = tiny_llama
    engine = make_engine(path)
    greedy = engine.add_request(prompt_token_ids=[1, 2, 3], sampling_params=SamplingParams(
        max_tokens=8, temperature=0, ignore_eos=True, logprobs=True))
    top1 = engine.add_request(prompt_token_ids=[1, 2, 3], sampling_params=SamplingParams(
        max_tokens=8, temperature=2.0, top_k=1, ignore_eos=True))
    outs = drain(engine)
    assert outs[greedy][-1].token_ids == outs[top1][-1].token_ids
    logprobs = outs[greedy][-1].logprobs
    assert len(logprobs) == 8 and all(lp <= 0 for lp in logprobs)
    assert outs[top1][-1].logprobs is None


@pytest.mark.parametrize("top_p", [1e-9, 2.2e-309])  # the second is subnormal: float32 rounds it to 0
def test_a_tiny_top_p_keeps_the_most_likely_token(tiny_llama, top_p):
    # schemathesis found a 500 here: a top_p that float32 rounds to 0 dropped every token
    engine = make_engine(tiny_llama[0])
    greedy = engine.add_request(prompt_token_ids=[1, 2, 3], sampling_params=SamplingParams(
        max_tokens=8, temperature=0, ignore_eos=True))
    nucleus = engine.add_request(prompt_token_ids=[1, 2, 3], sampling_params=SamplingParams(
        max_tokens=8, temperature=1.0, top_p=top_p, seed=3, ignore_eos=True))
    outs = drain(engine)
    assert outs[nucleus][-1].token_ids == outs[greedy][-1].token_ids


def test_top_logprobs_are_the_most_likely_tokens(tiny_llama):
    engine = make_engine(tiny_llama[0])
    rid = engine.add_request(prompt_token_ids=[1, 2, 3], sampling_params=SamplingParams(
        max_tokens=5, temperature=0, ignore_eos=True, top_logprobs=4))
    out = drain(engine)[rid][-1]
    assert len(out.top_logprobs) == 5
    for token, chosen, top in zip(out.token_ids, out.logprobs, out.top_logprobs, strict=True):
        values = [v for _, v in top]
        assert len(top) == 4 and values == sorted(values, reverse=True)
        assert top[0] == (token, chosen)  # greedy picks the most likely token
    with pytest.raises(InvalidRequestError, match="top_logprobs"):
        SamplingParams(top_logprobs=21)


def test_stop_token_ids_eos_and_max_model_len(tiny_llama):
    path, _ = tiny_llama
    engine = make_engine(path, max_model_len=20)
    probe = engine.add_request(prompt_token_ids=[4, 5], sampling_params=SamplingParams(
        max_tokens=10, temperature=0, ignore_eos=True))
    tokens = drain(engine)[probe][-1].token_ids
    stop_at = tokens[3]
    first = tokens.index(stop_at)
    rid = engine.add_request(prompt_token_ids=[4, 5], sampling_params=SamplingParams(
        max_tokens=10, temperature=0, stop_token_ids=[stop_at]))
    out = drain(engine)[rid][-1]
    assert (out.token_ids, out.finish_reason, out.stop_reason) == (tokens[: first + 1], "stop", stop_at)
    # the model's EOS ends a request unless ignore_eos
    engine.core.eos_token_ids = frozenset({stop_at})
    rid = engine.add_request(prompt_token_ids=[4, 5], sampling_params=SamplingParams(max_tokens=10, temperature=0))
    out = drain(engine)[rid][-1]
    assert (out.token_ids, out.finish_reason, out.stop_reason) == (tokens[: first + 1], "stop", None)
    # max_model_len caps prompt + output
    rid = engine.add_request(prompt_token_ids=list(range(1, 16)), sampling_params=SamplingParams(
        max_tokens=100, temperature=0, ignore_eos=True))
    out = drain(engine)[rid][-1]
    assert (len(out.token_ids), out.finish_reason) == (5, "length")


def test_the_stop_token_adds_no_text(tiny_dir):
    """The EOS or stop token id that ends a request stays in its token ids but adds nothing to its text,
    as vLLM does."""
    engine = make_engine(tiny_dir, max_model_len=40)
    probe = engine.add_request(prompt_token_ids=[4, 5], sampling_params=SamplingParams(
        max_tokens=30, temperature=0, ignore_eos=True))
    probed = drain(engine)[probe][-1]
    tokens, decode = probed.token_ids, engine.tokenizer.decode
    # the first token, where it first appears, that adds text
    at = next(i for i, t in enumerate(tokens) if t not in tokens[:i] and decode(tokens[: i + 1]) != decode(tokens[:i]))
    rid = engine.add_request(prompt_token_ids=[4, 5], sampling_params=SamplingParams(
        max_tokens=30, temperature=0, stop_token_ids=[tokens[at]]))
    out = drain(engine)[rid][-1]
    assert (out.token_ids, out.finish_reason, out.stop_reason) == (tokens[: at + 1], "stop", tokens[at])
    assert out.text == decode(tokens[:at]) != decode(tokens[: at + 1])
    engine.core.eos_token_ids = frozenset({tokens[at]})
    rid = engine.add_request(prompt_token_ids=[4, 5], sampling_params=SamplingParams(max_tokens=30, temperature=0))
    out = drain(engine)[rid][-1]
    assert (out.token_ids, out.finish_reason, out.text) == (tokens[: at + 1], "stop", decode(tokens[:at]))


def test_abort_frees_blocks_at_next_step_and_reports_once(tiny_llama):
    path, _ = tiny_llama
    engine = make_engine(path)
    keep = engine.add_request(prompt_token_ids=[3] * 40,
                              sampling_params=SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    gone = engine.add_request(prompt_token_ids=[7] * 40,
                              sampling_params=SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    for _ in range(3):
        engine.step()
    used = engine.block_manager.num_used_blocks
    engine.abort_request(gone)
    outs = engine.step()
    assert [o.finish_reason for o in outs if o.request_id == gone] == ["abort"]
    assert engine.block_manager.num_used_blocks < used
    assert gone not in engine.block_manager.block_tables
    rest = drain(engine)
    assert gone not in rest and rest[keep][-1].finish_reason == "length"
    engine.abort_request(keep)  # already finished: a no-op
    assert engine.step() == []


@pytest.mark.parametrize("field, kwargs", [
    ("max_tokens", dict(max_tokens=0)),
    ("max_tokens", dict(max_tokens=-3)),
    ("top_p", dict(top_p=0.0)),
    ("top_p", dict(top_p=1.5)),
    ("temperature", dict(temperature=-1)),
    ("top_k", dict(top_k=-2)),
    ("stop", dict(stop=[""])),
])
def test_bad_sampling_params_name_the_field(field, kwargs):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == field and field in str(e.value)


def test_bad_prompts_raise_and_the_engine_keeps_serving(tiny_llama):
    path, _ = tiny_llama
    llm = LLM(config=EngineConfig(model=path, max_model_len=64, kv_cache_memory="4MiB"))
    engine = llm.engine
    running = engine.add_request(prompt_token_ids=[1, 2, 3],
                                 sampling_params=SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    engine.step()
    cases = [
        (dict(prompt_token_ids=[]), "prompt"),
        (dict(prompt_token_ids=[[1, 2], []]), "prompt"),
        (dict(prompt_token_ids=list(range(1, 65))), "prompt"),  # 64 tokens, max_model_len 64
        (dict(prompt_token_ids=[1, 99999]), "prompt"),
        (dict(prompts="hello"), "prompt"),  # this tiny model has no tokenizer
    ]
    for kwargs, field in cases:
        with pytest.raises(InvalidRequestError) as e:
            llm.generate(sampling_params=SamplingParams(max_tokens=2), **kwargs)
        assert e.value.param == field
    with pytest.raises(InvalidRequestError, match="64 tokens.*max_model_len is 64"):
        llm.generate(prompt_token_ids=list(range(1, 65)))
    # a batch with one bad prompt queues none of them
    with pytest.raises(InvalidRequestError, match="prompt 1"):
        llm.generate(prompt_token_ids=[[1, 2], [1, 10**6]])
    outs = drain(engine)
    assert set(outs) == {running} and outs[running][-1].finish_reason == "length"
    assert llm.generate(prompt_token_ids=[[4, 5]], sampling_params=SamplingParams(max_tokens=3))[0].finished


@pytest.mark.parametrize("field, kwargs", [
    ("dtype", dict(dtype="int8")),
    ("policy", dict(policy="fifo")),
    ("max_num_seqs", dict(max_num_seqs=0)),
    ("prefill_chunk_size", dict(prefill_chunk_size=-1)),
    ("kv_cache_memory", dict(kv_cache_memory="lots")),
    ("block_size", dict(block_size=0)),
])
def test_bad_engine_config_names_the_field(field, kwargs):
    with pytest.raises(InvalidRequestError) as e:
        EngineConfig(**kwargs)
    assert e.value.param == field


def test_unknown_model_path_and_too_small_kv_pool(tiny_llama, tmp_path):
    with pytest.raises((FileNotFoundError, ValueError), match="model"):
        LLM(model=str(tmp_path / "nope"))
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        make_engine(tiny_llama[0], kv_cache_memory=16 * 512 * 2, max_model_len=512)


def test_live_knob_change_is_validated_whole(tiny_llama):
    engine = make_engine(tiny_llama[0], max_num_seqs=4)
    before = engine.knobs.value
    with pytest.raises(InvalidRequestError) as e:
        engine.update_knobs(max_num_seqs=8, prefill_chunk_size=0)
    assert e.value.param == "prefill_chunk_size" and engine.knobs.value == before
    with pytest.raises(InvalidRequestError):
        engine.update_knobs(max_num_sequences=3)
    assert engine.update_knobs(max_num_seqs=8).max_num_seqs == 8 and engine.knobs.num_changes == 1


def test_tiny_temperature_is_greedy_not_nan(tiny_llama):
    engine = make_engine(tiny_llama[0])
    greedy = engine.add_request(prompt_token_ids=[1, 2],
                                sampling_params=SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    tiny = engine.add_request(prompt_token_ids=[1, 2],
                              sampling_params=SamplingParams(max_tokens=6, temperature=1e-40, ignore_eos=True))
    outs = drain(engine)
    assert outs[tiny][-1].token_ids == outs[greedy][-1].token_ids
