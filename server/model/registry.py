"""Which model class serves each Hugging Face architecture name: the one place the engine looks it up.
ModelConfig refuses names missing here, naming the architecture and listing these."""

from __future__ import annotations

from iterserve.server.model.gemma import GemmaForCausalLM
from iterserve.server.model.llama import LlamaForCausalLM
from iterserve.server.model.model_config import SUPPORTED_ARCHITECTURES, ModelConfig
from iterserve.server.model.phi3 import Phi3ForCausalLM

MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
}
assert set(MODEL_CLASSES) == set(SUPPORTED_ARCHITECTURES), "registry and ModelConfig disagree"


def model_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    return MODEL_CLASSES[config.architecture]


def build_model(config: ModelConfig, attention_fn, max_positions: int, layer_ops) -> LlamaForCausalLM:
    return model_class(config)(config, attention_fn, max_positions, layer_ops)
