"""Runs one step's forward pass over the paged KV cache and samples the next tokens.

The attention backend (server/runner/backends.py) decides the kernels: torch on CPU, Triton on CUDA.
On CUDA with Triton, decode-only steps replay CUDA graphs (server/runner/cuda_graphs.py) unless
`cuda_graphs` is off.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, TypeVar, cast

import torch

from iterserve.kernels import cpu_bf16_linear, cpu_decode_stack, cpu_layer_ops, cpu_paged_attention
from iterserve.server.engine.scheduler import SchedulerOutput
from iterserve.server.model.cpu_linear import onednn_packing_supported
from iterserve.server.model.model_config import ModelConfig
from iterserve.server.model.registry import build_model
from iterserve.server.model.rope import RotaryEmbedding
from iterserve.server.runner.backends import make_backend, num_sms
from iterserve.server.runner.logits_processors import apply_grammar_bitmask, process_logits
from iterserve.server.runner.sampler import EMPTY_OUTPUT, ModelRunnerOutput, greedy_output, sample, takes_argmax
from iterserve.server.runner.step_inputs import step_layout, to_step_inputs

if TYPE_CHECKING:  # CUDA graphs are imported only where they run
    from iterserve.server.engine.sampling_params import SamplingParams
    from iterserve.server.runner.cuda_graphs import StaticDecodeRunner

logger = logging.getLogger("iterserve.runner")
ModuleT = TypeVar("ModuleT", bound=torch.nn.Module)


def materialize(model: ModuleT, device: torch.device) -> ModuleT:
    """`model.to_empty(device=device)` for a model built on the meta device: every parameter and buffer
    replaced by an uninitialized tensor of its shape and dtype. to_empty's first call in a process costs
    ~0.3 s of CPU (its per-tensor empty_like goes through torch's Python references), a share of a new
    pod's start on a busy node."""
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                module._parameters[name] = torch.nn.Parameter(
                    torch.empty(param.shape, dtype=param.dtype, device=device), requires_grad=param.requires_grad)
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = torch.empty(buffer.shape, dtype=buffer.dtype, device=device)
    return model


class ModelRunner:
    def __init__(self, model_config: ModelConfig, weights: dict[str, torch.Tensor] | None, device: torch.device,
                 dtype: torch.dtype, max_model_len: int, block_size: int, *, attention_backend: str = "torch",
                 cuda_graphs: bool = False, max_graph_batch: int = 256, eos_token_ids=()):
        """weights: HF-named tensors, or None for random ("dummy") weights made on the device.
        eos_token_ids: what `min_tokens` bans until enough tokens were generated."""
        self.model_config = model_config
        self.eos_token_ids = frozenset(eos_token_ids)
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.backend = make_backend(attention_backend, device, model_config.num_key_value_heads)
        # Built on the meta device and cast there, so no time goes into random init and no full-size
        # fp32 copy is ever made on the device; weights are copied (and rounded) in after.
        with torch.device("meta"):
            model = build_model(model_config, self.backend.attention_fn, max_model_len, self.backend.layer_ops)
        model = materialize(model.to(dtype), device)
        for rope in (m for m in model.modules() if isinstance(m, RotaryEmbedding)):
            rope.build_cache()  # cos/sin stay fp32 (the Triton rotary reads them so)
        if weights is None:
            model.init_dummy_weights()
        else:
            model.load_weights(weights)
        if onednn_packing_supported(device, dtype):
            model.pack_linears()
        # which C++ CPU kernels serve (the torch path stands in for a missing one); empty where none applies
        self.cpu_kernels: dict[str, bool] = {}
        if self.backend.name == "torch" and device.type == "cpu" and dtype in (torch.float32, torch.bfloat16):
            # their one-time builds happen at start-up, not in a request's step
            self.cpu_kernels = {"paged_attention": cpu_paged_attention.available(),
                                "prefill_attention": cpu_paged_attention.prefill_available(),
                                "layer_ops": cpu_layer_ops.available()}
            if dtype == torch.bfloat16 and cpu_bf16_linear.available():  # where the decode stack can serve
                self.cpu_kernels["decode_stack"] = cpu_decode_stack.available()
        self.model = model.eval()
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.use_cuda_graphs = cuda_graphs and device.type == "cuda" and self.backend.name == "triton"
        self.max_graph_batch = max_graph_batch
        self.static_decode: StaticDecodeRunner | None = None
        self.generators: dict[str, torch.Generator] = {}  # seeded requests' samplers, by request id

    def kv_cache_bytes_per_block(self) -> int:
        cfg = self.model_config
        per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim
        return per_token * self.block_size * torch.empty((), dtype=self.dtype).element_size()

    def allocate_kv_cache(self, num_blocks: int) -> None:
        cfg = self.model_config
        shape = (num_blocks * self.block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.dtype, device=self.device),
             torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(cfg.num_hidden_layers)
        ]
        self.static_decode = None  # graphs hold the old cache's addresses
        if self.use_cuda_graphs:
            self.enable_static_decode(self.max_graph_batch, capture=True)

    def enable_static_decode(self, max_batch: int, capture: bool) -> None:
        """Run decode-only steps of up to max_batch requests from static buffers, captured as CUDA
        graphs when `capture` (CUDA only). Needs the Triton backend and an allocated KV cache."""
        from iterserve.server.runner.cuda_graphs import StaticDecodeRunner

        if self.backend.name != "triton" or not self.kv_caches:
            raise ValueError("static decode needs the Triton backend and an allocated KV cache")
        self.static_decode = StaticDecodeRunner(
            self.model, self.kv_caches, block_size=self.block_size, max_model_len=self.max_model_len,
            max_batch=max_batch, num_kv_heads=self.model_config.num_key_value_heads,
            num_sms=num_sms(self.device), device=self.device, capture=capture,
        )

    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for request_id in out.finished_request_ids:
            self.generators.pop(request_id, None)
        if out.is_empty:
            return EMPTY_OUTPUT
        layout = step_layout(out, self.block_size)
        hidden = None
        if self.static_decode is not None and self.static_decode.can_run(layout):
            try:
                hidden = self.static_decode.run(layout)
            except RuntimeError:  # a capture that fails must not take the engine down: run eagerly
                if not self.static_decode.capture:
                    raise
                logger.exception("decode step from CUDA graphs failed; decode steps run eagerly from now on")
                self.static_decode = None
        if hidden is not None:
            sample_indices = torch.from_numpy(layout.sample_indices).to(self.device)
        else:
            inputs = to_step_inputs(layout, self.device, self.backend.build_metadata)
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
            sample_indices = inputs.sample_indices
        if not layout.sampling:
            return EMPTY_OUTPUT
        hidden = hidden.index_select(0, sample_indices)
        if out.grammar_bitmask is None and self.model.config.final_logit_softcapping is None \
                and takes_argmax(layout.sampling):
            # a batch of plain greedy rows needs no float32 copy of its logits (64 x 49k on CPU: 2% of a step)
            return greedy_output(self.model.compute_logits(hidden, upcast=False), layout.sampling)
        logits = self.model.compute_logits(hidden)
        processed = process_logits(logits, layout.sampling, self.eos_token_ids)
        if out.grammar_bitmask is not None:
            processed = apply_grammar_bitmask(processed, logits, layout.sampling, out.grammar_bitmask)
        # the rows that sample carry their sampling params (ScheduledRequest.sampling_params)
        params = cast("list[SamplingParams]", [s.sampling_params for s in layout.sampling])
        return sample(processed, [s.request_id for s in layout.sampling], params,
                      self.generators, raw_logits=logits)
