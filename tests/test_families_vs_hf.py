"""Qwen3, Phi-3, Gemma 2 and Gemma 3 greedy outputs equal HF transformers' token for token: the checks of
tests/test_engine_vs_hf.py (batched, chunked, preempted, the torch attention path's padded groups),
collected here again with `tiny_model` standing for each of these families (tests/conftest.py builds them
with an 8-token sliding window and a soft-cap that bites)."""

from __future__ import annotations

import pytest
import torch

from iterserve.server.errors import InvalidRequestError
from tests.conftest import make_engine
from tests.test_engine_vs_hf import (  # noqa: F401  (collected here, with this module's tiny_model)
    assert_matches_hf,
    run,
    test_chunked_prefill,
    test_preemption_under_a_small_kv_pool,
    test_single_request,
    test_sixteen_concurrent_requests,
    test_torch_attention_path_in_padded_groups,
    workload,
)


@pytest.fixture(params=["qwen3", "phi3", "gemma2", "gemma3"])
def tiny_model(request, tiny_family):
    return tiny_family(request.param)


def test_phi3_longrope_within_the_original_context(tiny_family):
    """LongRoPE's short factors and attention factor (max/original positions = 2 here) match HF while
    sequences stay within original_max_position_embeddings, which therefore caps the context."""
    tiny = tiny_family("phi3-longrope")
    items = workload(8, seed=7)
    assert_matches_hf(tiny, run(make_engine(tiny[0], max_num_seqs=8), items), items)
    with pytest.raises(InvalidRequestError, match="context length 256"):
        make_engine(tiny[0], max_model_len=300)


@pytest.mark.parametrize("family", ["qwen3", "phi3"])
def test_triton_kernels_serve_the_families_without_masked_layers(tiny_family, family):
    """Qwen3's q/k norms ahead of the in-place Triton rotary, and Phi-3, on the Triton backend (interpreted
    on CPU): the torch path's tokens and top-5 logprobs."""
    from tests.test_triton_model_runner import assert_same_generations, generate

    path = tiny_family(family)[0]
    items = workload(3, seed=12, max_prompt=20, max_out=8)
    options = dict(block_size=4, prefill_chunk_size=8, max_num_batched_tokens=12, max_num_seqs=3, max_model_len=32)
    engine = make_engine(path, attention_backend="triton", **options)
    assert engine.model_runner.backend.name == "triton"
    assert_same_generations(generate(engine, items), generate(make_engine(path, **options), items))


def test_triton_backend_is_refused_for_sliding_window_and_soft_capped_layers(tiny_family):
    with pytest.raises(InvalidRequestError, match="triton does not implement .*Gemma2ForCausalLM"):
        make_engine(tiny_family("gemma2")[0], attention_backend="triton")


def test_gemma2_final_soft_cap_in_the_logprobs(tiny_family):
    """Greedy tokens cannot show the final logit soft-cap (tanh keeps the order); the logprobs do: a cap
    of 5 squeezes this model's logits, and the engine's top-5 equal HF's for every generated position."""
    from tests.test_triton_model_runner import generate

    path, model = tiny_family("gemma2")
    prompt = workload(1, seed=13, max_prompt=30)[0][0]
    (tokens, logprobs), = generate(make_engine(path), [(prompt, 6)])
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:]
    expected = torch.log_softmax(logits.float(), dim=-1).topk(5).values
    assert logits.abs().max() < 5.0  # capped: without the cap this model's logits exceed it
    torch.testing.assert_close(logprobs, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["qwen3", "phi3", "gemma2", "gemma3"])
def test_bf16_is_close_to_hf_bf16(tiny_family, family):
    """bf16 (what --dtype auto picks on CPUs with native bf16) against HF's own bf16 run, with
    tests/test_bf16.py's check: equal up to a rounding flip between top candidates."""
    from transformers import AutoModelForCausalLM

    from tests.test_bf16 import assert_close_to_hf, hf_bf16_reference, run_bf16

    path = tiny_family(family)[0]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    prompts = [p for p, _ in workload(6, seed=21, max_prompt=30)]
    _, outputs = run_bf16(path, prompts, max_num_seqs=6)
    assert_close_to_hf(outputs, hf_bf16_reference(model, prompts))
