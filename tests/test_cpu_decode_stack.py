"""The C++ decode stack (kernels/cpu_decode_stack.py) gives what the layer-by-layer path gives, bit for bit:
the same greedy tokens and the same logprobs for every request of a batch, under chunked prefill and
preemption, for Llama and Qwen2 (q/k/v biases, a tied head) and Phi-3; it runs every decode-only step
and no other; and it stays out of every model and setting whose layers it does not implement."""

from __future__ import annotations

import pytest
import torch

from iterserve.kernels import cpu_bf16_linear, cpu_decode_stack
from iterserve.kernels.cpu_decode_stack import DecodeStack
from iterserve.server.engine.sampling_params import SamplingParams
from tests.conftest import make_engine


@pytest.fixture(scope="module")
def stack_kernels():
    if not cpu_bf16_linear.available():
        pytest.skip("the bf16 linear kernel needs AVX512-BF16 and no AMX")
    if not cpu_decode_stack.available():
        pytest.fail("the C++ decode stack did not build")


@pytest.fixture(scope="module")
def qwen2_biased(tmp_path_factory):
    """A tiny Qwen2 whose q/k/v biases are drawn: HF's init leaves them zero, where a dropped bias shows
    nothing."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tests.conftest import TINY

    torch.manual_seed(1)
    model = Qwen2ForCausalLM(Qwen2Config(**TINY, tie_word_embeddings=True)).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.5)
    model.generation_config.eos_token_id = None
    path = tmp_path_factory.mktemp("tiny-qwen2-biased")
    model.save_pretrained(path)
    return str(path)


def _generate(path: str, prompts, max_tokens, **options):
    engine = make_engine(path, dtype="bfloat16", **options)
    stack = engine.model_runner.model.decode_stack
    calls: list[int] = []
    if stack is not None:
        real = stack._stack

        class Spy:  # counts the C++ stack's steps (their batch sizes), then runs them
            def forward(self, *args):
                calls.append(args[0].shape[0])
                return real.forward(*args)

        stack._stack = Spy()
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens, strict=True)):
        engine.add_request(prompt_token_ids=prompt, request_id=str(i),
                           sampling_params=SamplingParams(max_tokens=n, temperature=0, ignore_eos=True,
                                                          logprobs=True))
    results: dict[str, tuple[list[int], list[float]]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                results[o.request_id] = (o.token_ids, o.logprobs)
    return results, calls, engine


PROMPTS = [[(7 * i + 3 * j) % 300 + 10 for j in range(length)] for i, length in enumerate([5, 17, 1, 33, 9, 64])]
MAX_TOKENS = [20, 7, 31, 12, 40, 3]


@pytest.mark.parametrize("family", ["llama", "qwen2", "phi3"])
@pytest.mark.parametrize("options", [
    {},  # one prefill, then decode steps as requests finish
    {"prefill_chunk_size": 8, "max_num_batched_tokens": 16, "max_num_seqs": 4},  # chunks and mixed steps
    # 2 layers x 2 KV heads x 16 dims x bf16 x K,V = 256 B a token: 160 tokens, where the requests reach 489
    {"kv_cache_memory": "40KiB", "block_size": 4, "max_model_len": 128, "max_tokens": 60},
], ids=["plain", "chunked", "preempted"])
def test_the_stack_gives_the_layer_by_layer_tokens_and_logprobs_bit_for_bit(
        stack_kernels, family, options, tiny_llama, qwen2_biased, tiny_family, monkeypatch):
    path = {"llama": lambda: tiny_llama[0], "qwen2": lambda: qwen2_biased,
            "phi3": lambda: tiny_family("phi3")[0]}[family]()
    options = dict(options)
    max_tokens = [options.pop("max_tokens")] * len(PROMPTS) if "max_tokens" in options else MAX_TOKENS
    stacked, calls, engine = _generate(path, PROMPTS, max_tokens, **options)
    assert engine.model_runner.model.decode_stack is not None
    assert calls, "no step ran through the stack"
    assert max(calls) > 1, "no batched decode step ran through the stack"
    if options.get("kv_cache_memory"):
        assert engine.stats.num_preemptions > 0
    monkeypatch.setenv("ITERSERVE_CPU_DECODE_STACK", "torch")
    layered, calls_off, _ = _generate(path, PROMPTS, max_tokens, **options)
    assert calls_off == []
    assert stacked == layered  # tokens, and logprobs as floats: the same hidden states to the last bit


def test_every_decode_only_step_and_no_other_runs_through_the_stack(stack_kernels, tiny_llama):
    # six requests prefilled together, then decode steps only: one stack call per generated token after
    # the first (the prefill step samples the first), with the batch shrinking as requests finish
    _, calls, engine = _generate(tiny_llama[0], PROMPTS, MAX_TOKENS)
    assert len(calls) == max(MAX_TOKENS) - 1
    assert calls == [sum(n > step for n in MAX_TOKENS) for step in range(1, max(MAX_TOKENS))]


@pytest.mark.parametrize("switch", ["ITERSERVE_CPU_DECODE_STACK", "ITERSERVE_CPU_LAYER_OPS", "ITERSERVE_CPU_ATTENTION"])
def test_each_kill_switch_turns_the_stack_off_in_process(stack_kernels, tiny_llama, monkeypatch, switch):
    engine = make_engine(tiny_llama[0], dtype="bfloat16")
    assert engine.model_runner.model.decode_stack is not None
    monkeypatch.setenv(switch, "torch")
    assert not DecodeStack.serves(torch.zeros(1, 4, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.bfloat16))
    monkeypatch.delenv(switch)
    assert DecodeStack.serves(torch.zeros(1, 4, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.bfloat16))


def test_no_stack_where_a_layer_has_what_it_does_not_implement(stack_kernels, tiny_llama, tiny_family, monkeypatch):
    # fp32 (oneDNN's linears, not the bf16 kernel), q/k norms (Qwen3), Gemma's layers (window, soft-cap,
    # its own MLP and norms): layer by layer
    assert make_engine(tiny_llama[0], dtype="float32").model_runner.model.decode_stack is None
    for family in ("qwen3", "gemma2", "gemma3"):
        assert make_engine(tiny_family(family)[0], dtype="bfloat16").model_runner.model.decode_stack is None, family
    # the bf16 linear's switch is read when the weights are packed: with oneDNN's linears, no stack
    monkeypatch.setenv("ITERSERVE_CPU_BF16_LINEAR", "torch")
    assert make_engine(tiny_llama[0], dtype="bfloat16").model_runner.model.decode_stack is None


def test_a_capsule_of_another_table_is_refused(stack_kernels, tiny_llama):
    from iterserve.kernels import cpu_paged_attention

    stack = make_engine(tiny_llama[0], dtype="bfloat16").model_runner.model.decode_stack
    assert stack is not None
    linear = cpu_bf16_linear._extension.loaded().c_api
    module = cpu_decode_stack._extension.loaded()
    w = torch.zeros(4, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="iterserve.c_api.LayerOps"):
        module.DecodeStack(linear, linear, cpu_paged_attention._extension.loaded().c_api, [w], [w], [w], [None],
                           [w], [None], [w], [w], [w], [w], w, 1e-6, 4, 2, 16, 64, 128, 0.25)
