"""The model runner on the Triton backend (forced on, interpreted on CPU) gives the torch path's greedy
tokens on a tiny model: chunked prefill mixed with decodes, preemption and recompute, and decode
steps run from the static buffers CUDA graphs replay. The top-5 logprobs of every step are compared
too: greedy tokens of a tiny random model survive small errors that the logprobs show. Also the
graph buckets and padding."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from iterserve.server.engine.sampling_params import SamplingParams
from iterserve.server.errors import InvalidRequestError
from iterserve.server.runner.cuda_graphs import bucket_for, capture_sizes, pad_decode_step
from iterserve.server.runner.step_inputs import StepLayout
from tests.conftest import make_engine
from tests.test_engine_vs_hf import workload
from tests.triton_support import make_block_tables  # noqa: F401  (sets TRITON_INTERPRET first)


def generate(engine, items):
    """(token ids, [top-5 logprobs per position]) of each request, greedy."""
    ids = [engine.add_request(prompt_token_ids=p, sampling_params=SamplingParams(
        max_tokens=n, temperature=0, ignore_eos=True, top_logprobs=5)) for p, n in items]
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    return [(done[i].token_ids, torch.tensor([[lp for _, lp in top] for top in done[i].top_logprobs]))
            for i in ids]


def assert_same_generations(got, expected):
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, expected, strict=True):
        assert tokens == want_tokens
        torch.testing.assert_close(logprobs, want_logprobs, atol=1e-4, rtol=0)


def test_triton_backend_matches_torch_with_chunked_prefill_and_preemption(tiny_llama):
    path = tiny_llama[0]
    items = workload(4, seed=11, max_prompt=24, max_out=16)
    # block size 4 and 12 KV blocks: 12 prompt tokens a step mixed with decodes, contexts ending mid-block,
    # and a request preempted and recomputed once the pool runs out
    options = dict(block_size=4, prefill_chunk_size=12, max_num_batched_tokens=16, max_num_seqs=4,
                   max_model_len=48, kv_cache_memory=12 * 4 * 512)
    engine = make_engine(path, attention_backend="triton", **options)
    assert engine.model_runner.backend.name == "triton"
    got = generate(engine, items)
    assert engine.stats.num_preemptions > 0
    assert_same_generations(got, generate(make_engine(path, **options), items))


def test_triton_backend_reads_cached_prefixes_like_torch(tiny_llama):
    """Prefix caching on the Triton kernels: requests admitted at a computed count > 0 over blocks another
    request computed (in an earlier step, or in the same step: the KV write runs before attention),
    through the prefill kernel and, when all but the last token is cached, the decode kernel."""
    from tests.test_prefix_cache_vs_hf import shared_prefix_items

    path = tiny_llama[0]
    items = shared_prefix_items(6, seed=13, prefix_lens=(5, 8, 12), max_suffix=10, max_out=8)
    options = dict(block_size=4, prefill_chunk_size=12, max_num_batched_tokens=16, max_num_seqs=6, max_model_len=48)
    engine = make_engine(path, attention_backend="triton", **options)
    got = generate(engine, items)
    assert engine.stats.prefix_cache_hits > 0
    assert_same_generations(got, generate(make_engine(path, enable_prefix_caching=False, **options), items))


def test_static_decode_buffers_match_torch(tiny_llama):
    """The path CUDA graphs capture (padded static buffers), run eagerly on CPU."""
    path = tiny_llama[0]
    items = workload(3, seed=12, max_prompt=20, max_out=12)
    engine = make_engine(path, attention_backend="triton", block_size=8)
    engine.model_runner.enable_static_decode(max_batch=2, capture=False)  # batch 3 runs eagerly
    decode_steps = []
    original = engine.model_runner.static_decode.run
    engine.model_runner.static_decode.run = lambda layout: decode_steps.append(len(layout.num_new)) or original(layout)
    got = generate(engine, items)
    assert_same_generations(got, generate(make_engine(path, block_size=8), items))
    assert decode_steps and max(decode_steps) <= 2


def test_triton_backend_on_cpu_needs_the_interpreter(tiny_llama, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(InvalidRequestError, match="attention_backend"):
        make_engine(tiny_llama[0], attention_backend="triton")


@pytest.mark.parametrize("max_batch, sizes", [
    (1, [1]), (3, [1, 2, 3]), (8, [1, 2, 4, 8]), (20, [1, 2, 4, 8, 16, 20]), (32, [1, 2, 4, 8, 16, 24, 32]),
])
def test_capture_sizes(max_batch, sizes):
    assert capture_sizes(max_batch) == sizes


@pytest.mark.parametrize("num_seqs, bucket", [(1, 1), (3, 4), (5, 8), (17, 24), (32, 32), (33, None), (0, None)])
def test_bucket_for(num_seqs, bucket):
    assert bucket_for(num_seqs, capture_sizes(32)) == bucket


def _decode_layout(contexts: list[int], block_size: int) -> StepLayout:
    n = len(contexts)
    ends = np.array(contexts)
    tables = np.arange(n * 4).reshape(n, 4)[:, ::-1].copy()
    positions = ends - 1
    return StepLayout(block_size=block_size, input_ids=[5 + i for i in range(n)], positions=positions,
                      slots=tables[np.arange(n), positions // block_size] * block_size + positions % block_size,
                      starts=np.arange(n), num_new=np.ones(n, dtype=np.int64), computed=positions, ends=ends,
                      tables=tables, sample_indices=np.arange(n), sampling=[])


def test_pad_decode_step_pads_rows_that_write_and_read_nothing():
    layout = _decode_layout([3, 9], block_size=4)
    p = pad_decode_step(layout, 4)
    assert p.input_ids.tolist() == [5, 6, 0, 0]
    assert p.positions.tolist() == [2, 8, 0, 0]
    assert p.slots.tolist() == [layout.slots[0], layout.slots[1], -1, -1]
    assert p.context_lens.tolist() == [3, 9, 0, 0]
    assert p.block_tables.tolist() == layout.tables[:, :3].tolist()  # as wide as the longest context needs
    with pytest.raises(ValueError):
        pad_decode_step(layout, 1)
    prefill = _decode_layout([3, 9], block_size=4)
    prefill.num_new = np.array([1, 2])
    with pytest.raises(ValueError):
        pad_decode_step(prefill, 4)


def test_dummy_load_format_builds_the_configs_shape_with_random_weights(tmp_path, tiny_llama):
    import shutil

    shutil.copy(f"{tiny_llama[0]}/config.json", tmp_path / "config.json")  # no weights at all
    engine = make_engine(str(tmp_path), load_format="dummy")
    model = engine.model_runner.model
    qkv = model.layers[0].self_attn.qkv_proj
    weight_t = qkv(torch.eye(model.config.hidden_size))  # through whatever form the CPU path packed it in
    assert weight_t.std().item() == pytest.approx(0.02, rel=0.2)
    assert torch.equal(model.norm.weight, torch.ones_like(model.norm.weight))
    assert engine.tokenizer is None
    out = generate(engine, [([1, 2, 3], 4)])
    assert len(out[0][0]) == 4


@pytest.mark.parametrize("field, value", [
    ("attention_backend", "cuda"), ("load_format", "safetensors"), ("cuda_graphs", "yes"),
])
def test_engine_config_refuses_bad_backend_options(field, value):
    from iterserve.server.config import EngineConfig

    with pytest.raises(InvalidRequestError, match=field):
        EngineConfig(**{field: value})


def test_cli_flags_reach_the_engine_config():
    import argparse

    from iterserve.server.entrypoints.cli_args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = engine_config_from_args(parser.parse_args(
        ["--attention-backend", "triton", "--enforce-eager", "--load-format", "dummy"]))
    assert (config.attention_backend, config.cuda_graphs, config.load_format) == ("triton", False, "dummy")
    assert engine_config_from_args(parser.parse_args([])).cuda_graphs is True
