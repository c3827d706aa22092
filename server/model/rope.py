"""Rotary position embeddings with the scaling variants Llama-family configs use (HF's rotate-half form).

Frequencies follow transformers' modeling_rope_utils exactly (fp32), so greedy outputs match HF.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from iterserve.server.model.model_config import SUPPORTED_ROPE_TYPES, ModelConfig


def _default_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(base: float, dim: int, s: dict, max_pos: int) -> tuple[torch.Tensor, float]:
    orig = s["original_max_position_embeddings"]
    factor = s.get("factor") or max_pos / orig

    def get_mscale(scale, mscale=1.0):
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        if s.get("mscale") and s.get("mscale_all_dim"):
            attention_factor = get_mscale(factor, s["mscale"]) / get_mscale(factor, s["mscale_all_dim"])
        else:
            attention_factor = get_mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations):
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def _longrope_inv_freq(base: float, dim: int, s: dict, max_pos: int) -> tuple[torch.Tensor, float]:
    """Phi-3's LongRoPE with its short factors, which HF uses while a sequence stays within
    original_max_position_embeddings; ModelConfig.context_len keeps every sequence there."""
    orig = s["original_max_position_embeddings"]
    factor = s.get("factor") or max_pos / orig
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    short = torch.tensor(s["short_factor"], dtype=torch.float32)
    if short.shape != (dim // 2,):
        raise ValueError(f"rope_scaling.short_factor: expected {dim // 2} factors, got {tuple(short.shape)}")
    return 1.0 / (short * base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), float(attention_factor)


def compute_inv_freq(cfg: ModelConfig, local: bool = False) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scaling factor for this config; `local`: for Gemma 3's
    sliding-window layers, which have their own theta and no scaling."""
    s = {} if local else dict(cfg.rope_scaling or {})
    rope_type = s.get("rope_type", s.get("type", "default"))
    base, dim = (cfg.local_rope_theta if local else cfg.rope_theta), cfg.head_dim
    assert base is not None  # local layers exist only where the config gave their theta (Gemma 3)
    inv_freq = _default_inv_freq(base, dim)
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / s["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, s), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(base, dim, s, cfg.max_position_embeddings)
    if rope_type == "longrope":
        return _longrope_inv_freq(base, dim, s, cfg.max_position_embeddings)
    raise ValueError(f"rope_scaling.rope_type: {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})")


class RotaryEmbedding(nn.Module):
    cos_cache: torch.Tensor  # [max_positions, head_dim] fp32 buffers, made by build_cache
    sin_cache: torch.Tensor

    def __init__(self, cfg: ModelConfig, max_positions: int, local: bool = False):
        super().__init__()
        self.config = cfg
        self.local = local
        self.max_positions = max_positions
        self.register_buffer("cos_cache", torch.empty(max_positions, cfg.head_dim), persistent=False)
        self.register_buffer("sin_cache", torch.empty(max_positions, cfg.head_dim), persistent=False)
        self.build_cache()
        # Every layer of a step rotates at the same positions: look them up once per step.
        self._last_positions: torch.Tensor | None = None
        self._last_cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None

    def build_cache(self) -> None:
        """(Re)compute cos/sin in fp32 on the buffers' device; the model is built on the meta device."""
        if self.cos_cache.is_meta:
            return
        inv_freq, scaling = compute_inv_freq(self.config, self.local)
        positions = torch.arange(self.max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos_cache = (emb.cos() * scaling).to(self.cos_cache.device)
        self.sin_cache = (emb.sin() * scaling).to(self.sin_cache.device)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Rotate x: [num_tokens, heads, head_dim], token i at positions[i]."""
        if positions is not self._last_positions:
            cos = self.cos_cache.index_select(0, positions).to(x.dtype).unsqueeze(1)
            sin = self.sin_cache.index_select(0, positions).to(x.dtype).unsqueeze(1)
            self._last_positions, self._last_cos_sin = positions, (cos, sin)
        assert self._last_cos_sin is not None  # set with _last_positions
        cos, sin = self._last_cos_sin
        return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
