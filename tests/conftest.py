"""Shared fixtures: tiny random HF models built offline, and engines over them."""

from __future__ import annotations

import os

# The Triton kernel tests run under the interpreter. Triton decorates its own `tl.*` helpers when it is
# first imported, and that decides interpreted or compiled for good; transformers (and schemathesis)
# import triton, so the switch must be set before any test module imports anything.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from iterserve.server.config import EngineConfig
from iterserve.server.engine.engine_factory import build_engine
from tests.kube_support import kube_cluster, kube_namespace  # noqa: F401  (a real Kubernetes API server)

TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def save_tiny(model_cls, config, path, qk_gain: float = 1.0):
    """qk_gain scales the q and k projections: attention scores large enough for a soft-cap to bite."""
    torch.manual_seed(0)
    model = model_cls(config).eval()
    # Random init gives near-uniform logits, where a last-bit difference could flip an argmax;
    # sharpen the head so greedy decoding has clear winners, as a trained model does.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
        for name, param in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(qk_gain)
    model.generation_config.eos_token_id = None
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(**TINY, tie_word_embeddings=False)
    return str(path), save_tiny(LlamaForCausalLM, config, path)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = tmp_path_factory.mktemp("tiny-qwen2")
    config = Qwen2Config(**TINY, tie_word_embeddings=True)
    return str(path), save_tiny(Qwen2ForCausalLM, config, path)


def _tiny_family(tmp_path_factory, name: str):
    """A tiny random model of one of the families beyond Llama/Qwen2, with the features that set it apart
    switched on at sizes a short prompt reaches (an 8-token sliding window, a soft-cap that bites)."""
    import transformers as tf

    special = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model_cls, config = {
        "qwen3": lambda: (tf.Qwen3ForCausalLM, tf.Qwen3Config(**TINY, head_dim=16, tie_word_embeddings=True)),
        "phi3": lambda: (tf.Phi3ForCausalLM, tf.Phi3Config(**TINY, **special)),
        "phi3-longrope": lambda: (tf.Phi3ForCausalLM, tf.Phi3Config(
            **TINY, **special, original_max_position_embeddings=256, rope_parameters={
                "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + 0.25 * i for i in range(8)],
                "long_factor": [2.0 + i for i in range(8)]})),
        "gemma2": lambda: (tf.Gemma2ForCausalLM, tf.Gemma2Config(
            **TINY, **special, head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
            attn_logit_softcapping=2.0, final_logit_softcapping=5.0)),
        "gemma3": lambda: (tf.Gemma3ForCausalLM, tf.Gemma3TextConfig(
            **TINY, **special, head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
            layer_types=["sliding_attention", "full_attention"])),
    }[name]()
    path = tmp_path_factory.mktemp(f"tiny-{name}")
    return str(path), save_tiny(model_cls, config, path, qk_gain=30.0 if name == "gemma2" else 1.0)


@pytest.fixture(scope="session")
def tiny_family(tmp_path_factory):
    """name -> (path, HF model) of a tiny model of that family (qwen3, phi3, phi3-longrope, gemma2,
    gemma3), built once."""
    built: dict[str, tuple] = {}

    def get(name: str):
        if name not in built:
            built[name] = _tiny_family(tmp_path_factory, name)
        return built[name]

    return get


@pytest.fixture(scope="session")
def tiny_dir(tiny_llama, tmp_path_factory):
    """The tiny Llama with a byte-level tokenizer and a chat template, for the server tests."""
    from tests.server_support import add_tiny_tokenizer

    return add_tiny_tokenizer(tiny_llama[0], tmp_path_factory.mktemp("tiny-tok"))


@pytest.fixture(params=["llama", "qwen2"])
def tiny_model(request):
    return request.getfixturevalue(f"tiny_{request.param}")


def make_engine(model_path: str, **options):
    options.setdefault("kv_cache_memory", "8MiB")
    # fp32 unless a test asks otherwise: the outputs are compared with HF's fp32 token for token, and
    # "auto" is bf16 on CPUs with native bf16 (tests/test_bf16.py covers that path)
    options.setdefault("dtype", "float32")
    return build_engine(EngineConfig(model=model_path, **options))


def hf_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    """HF transformers' own greedy generate, EOS disabled (our requests use ignore_eos)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


KUBE_FIXTURES = {"kube_cluster", "kube_namespace"}

# Modules whose tests are all `slow`: they start servers, compare the engine with HF transformers' generate
# over many batches, build the C++ kernels, run Triton kernels under the interpreter or run the bundled
# default model (seconds to minutes each). `-m "not kube and not slow"` is the fast pass (README).
SLOW_MODULES = {
    "test_bf16", "test_cpu_kernels_prebuilt", "test_cpu_layer_ops", "test_cpu_layer_ops_bf16", "test_cpu_linear",
    "test_cpu_paged_attention", "test_default_model", "test_engine_vs_hf", "test_families_vs_hf", "test_loader",
    "test_logits_processing", "test_prefix_cache_vs_hf", "test_tokenizer",
    "test_server_admin", "test_server_admin_port", "test_server_drain", "test_server_heavy_requests",
    "test_server_limits", "test_server_openai", "test_server_prefix_cache", "test_server_process_imports",
    "test_server_robustness",
    "test_server_schemathesis", "test_server_slow_clients", "test_server_structured_output", "test_server_tokenize",
    "test_server_tools",
    "test_structured_output",
    "test_triton_attention", "test_triton_compile", "test_triton_gpu_benchmark", "test_triton_layer_ops",
    "test_triton_model_runner", "test_tuning_benchmark_smoke", "test_tuning_e2e", "test_tuning_live",
    "test_tuning_simulation", "test_operator_scale_smoke",
}


def pytest_collection_modifyitems(config, items):
    """Every test that uses the real Kubernetes API server is marked `kube`, so `-m "not kube"` leaves
    out the tests that need the apiserver binaries (scripts/bootstrap.sh --with-kube); every test of
    SLOW_MODULES is marked `slow`."""
    for item in items:
        if KUBE_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.kube)
        if item.module is not None and item.module.__name__.rsplit(".", 1)[-1] in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
