"""Build an engine core from an EngineConfig (pick device and dtype, load the model, size the KV pool),
and the in-process LLMEngine around it."""

from __future__ import annotations

import atexit
import gc
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from iterserve.server.config import EngineConfig, parse_memory
from iterserve.server.engine.core import EngineCore
from iterserve.server.engine.grammar_manager import GrammarManager
from iterserve.server.engine.llm_engine import LLMEngine
from iterserve.server.errors import InvalidRequestError
from iterserve.server.model.cpu_linear import cpu_has_native_bf16
from iterserve.server.model.loader import load_model
from iterserve.server.runner.backends import resolve_backend_name
from iterserve.server.runner.model_runner import ModelRunner

if TYPE_CHECKING:  # the tokenizer libraries load with the first tokenizer
    from iterserve.server.model.tokenizer import Tokenizer

logger = logging.getLogger("iterserve.engine")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_CPU_DEFAULT_KV_BYTES = 2**30
# decode steps of more requests than this run eagerly (their graphs would cost memory and capture time)
_MAX_GRAPH_BATCH = 512


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidRequestError("device", "CUDA was asked for but is not available")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: bf16 on CUDA and on CPUs that multiply bf16 natively (AVX-512 BF16, AMX), as vLLM does;
    fp32 on other CPUs, where bf16 matmuls are emulated and several times slower than fp32."""
    if name == "auto":
        if device.type == "cuda" or cpu_has_native_bf16():
            return torch.bfloat16
        return torch.float32
    return _DTYPES[name]


def kv_cache_budget_bytes(value, device: torch.device) -> int:
    """The KV pool's size in bytes, from bytes or a fraction of the memory still free."""
    if value is None:
        value = 0.9 if device.type == "cuda" else _CPU_DEFAULT_KV_BYTES
    kind, number = parse_memory(value)
    if kind == "bytes":
        return int(number)
    return int(number * _free_memory_bytes(device))


def _free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


@dataclass
class BuiltCore:
    core: EngineCore
    tokenizer: Tokenizer | None
    vocab_size: int
    kv_cache_report: str
    cpu_kernels: dict[str, bool]  # ModelRunner.cpu_kernels


def build_engine(config: EngineConfig) -> LLMEngine:
    built = build_engine_core(config)
    engine = LLMEngine.from_core(built.core, built.tokenizer, built.vocab_size)
    engine.kv_cache_report = built.kv_cache_report
    return engine


def _backend_for_model(backend: str, requested: str, mc) -> str:
    """The Triton kernels implement neither sliding windows nor score soft-capping: a model that needs
    them (Gemma) runs the torch attention path, chosen for it under `auto` and refused for `triton`."""
    if backend != "triton" or not mc.needs_masked_attention:
        return backend
    if requested == "auto":
        logger.warning("%s needs sliding-window or soft-capped attention, which the Triton kernels do not "
                       "implement; attention runs on the torch path", mc.architecture)
        return "torch"
    raise InvalidRequestError(
        "attention_backend", f"triton does not implement the sliding-window/soft-capped attention "
        f"{mc.architecture} needs; use torch (or auto)")


def build_engine_core(config: EngineConfig) -> BuiltCore:
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    torch.manual_seed(config.seed)
    backend = resolve_backend_name(config.attention_backend, device)  # refuse before the slow load

    loaded = load_model(config.model, config.load_format)
    from iterserve.server.model.tokenizer import load_config_tokenizer  # with the first tokenizer

    tokenizer = load_config_tokenizer(config, loaded.path)
    mc = loaded.config
    backend = _backend_for_model(backend, config.attention_backend, mc)
    context_len = mc.context_len
    if config.max_model_len is not None and config.max_model_len > context_len:
        raise InvalidRequestError(
            "max_model_len", f"{config.max_model_len} exceeds the model's context length {context_len}"
        )
    max_model_len = config.max_model_len or context_len

    eos_token_ids = _eos_ids(mc, tokenizer)
    runner = ModelRunner(mc, loaded.weights, device, dtype, max_model_len, config.block_size,
                         attention_backend=backend, cuda_graphs=config.cuda_graphs,
                         max_graph_batch=min(config.max_num_seqs, _MAX_GRAPH_BATCH), eos_token_ids=eos_token_ids)
    del loaded  # the runner holds its own copy of the weights now
    bytes_per_block = runner.kv_cache_bytes_per_block()
    budget = kv_cache_budget_bytes(config.kv_cache_memory, device)
    num_blocks = budget // bytes_per_block
    if num_blocks < 1:
        raise InvalidRequestError(
            "kv_cache_memory", f"{budget} bytes is less than one KV block ({bytes_per_block} bytes)"
        )
    core = EngineCore(runner, max_model_len=max_model_len, num_blocks=num_blocks, block_size=config.block_size,
                      knobs=config.initial_knobs(), policy=config.policy, eos_token_ids=eos_token_ids,
                      enable_prefix_caching=config.enable_prefix_caching,
                      grammar=None if tokenizer is None else GrammarManager(
                          tokenizer, mc.vocab_size, eos_token_ids,
                          # the masks fill beside the forward pass: on a CPU model it holds the cores
                          fill_threads=1 if device.type == "cpu" else torch.get_num_threads()))
    runner.allocate_kv_cache(num_blocks)
    report = (
        f"KV cache: {num_blocks} blocks x {config.block_size} tokens = {num_blocks * config.block_size} tokens, "
        f"{num_blocks * bytes_per_block / 2**20:.0f} MiB ({dtype}, {device}); max_model_len {max_model_len}; "
        f"attention {backend}{', CUDA graphs' if runner.use_cuda_graphs else ''}; "
        f"prefix caching {'on' if config.enable_prefix_caching else 'off'}"
    )
    logger.info(report)
    # Everything built so far (the model's modules, the tokenizer, the loaded libraries) lives as long as
    # the engine: moved out of the collector's reach, a full collection no longer walks it. Each step
    # makes garbage, and the collections it set off took a few percent of a busy engine's time.
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)  # at exit everything is collectable again: extensions check for leaks
    return BuiltCore(core, tokenizer, mc.vocab_size, report, runner.cpu_kernels)


def _eos_ids(mc, tokenizer) -> set[int]:
    ids = set(mc.eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
