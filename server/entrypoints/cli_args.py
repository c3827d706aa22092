"""Engine flags shared by every subcommand that builds an engine (`generate`, `serve`)."""

from __future__ import annotations

import argparse

from iterserve.common import wire
from iterserve.server.config import ATTENTION_BACKENDS, DTYPES, LOAD_FORMATS, EngineConfig
from iterserve.server.engine.scheduler import POLICIES


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="HF model directory or .gguf file (default: the bundled SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="auto", choices=DTYPES, help="auto: float32 on CPU, bfloat16 on CUDA")
    g.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    g.add_argument("--max-model-len", type=int, default=None, help="prompt + output limit in tokens")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    g.add_argument("--kv-cache-memory", default=None,
                   help="KV pool size: bytes (e.g. 2GiB) or a fraction (e.g. 0.5) of free memory")
    for knob in wire.KNOBS:  # live: PATCH /admin/scheduler changes them on a running server
        g.add_argument(knob.flag, type=int, default=knob.default, help=f"{knob.help} (live knob)")
    g.add_argument("--policy", default="continuous", choices=POLICIES, help="scheduling policy")
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    g.add_argument("--engine-seed", type=int, default=0, help="seed for requests without their own")
    g.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
                   help="auto: the Triton kernels on CUDA, torch on CPU")
    g.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs for decode steps (CUDA with the Triton backend only)")
    g.add_argument("--load-format", default="auto", choices=LOAD_FORMATS,
                   help="dummy: random weights in the shape of the model directory's config.json")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        prefill_chunk_size=args.prefill_chunk_size,
        policy=args.policy,
        num_threads=args.threads,
        seed=args.engine_seed,
        attention_backend=args.attention_backend,
        cuda_graphs=not args.enforce_eager,
        load_format=args.load_format,
    )
