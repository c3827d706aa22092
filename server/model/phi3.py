"""Phi-3 (Phi3ForCausalLM): the Llama network; only the checkpoint differs, storing q/k/v as one
`qkv_proj` and gate/up as one `gate_up_proj` ([gate | up], as this engine fuses them), so they load as
they are."""

from __future__ import annotations

from iterserve.server.model.llama import LlamaForCausalLM
from iterserve.server.model.model_config import ModelConfig


class Phi3ForCausalLM(LlamaForCausalLM):
    def checkpoint_names(self, name: str) -> list[str]:
        return [name] if name == "lm_head.weight" else [f"model.{name}"]

    @classmethod
    def checkpoint_shapes(cls, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        shapes = super().checkpoint_shapes(config)
        h, inter = config.hidden_size, config.intermediate_size
        qkv_out = (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
                del shapes[f"{p}{name}.weight"]
            shapes[p + "self_attn.qkv_proj.weight"] = (qkv_out, h)
            shapes[p + "mlp.gate_up_proj.weight"] = (2 * inter, h)
        return shapes
