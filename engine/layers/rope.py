"""Rotary position embedding (GPT-NeoX "rotate half" layout, as every supported family uses).

cos/sin are tabulated once for every position up to the model length, in fp32, then cast to the
model dtype exactly as transformers does (it computes them in fp32 and casts before use), so bf16
runs round the same way.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from freetoken_agent.engine.config import ModelSpec, RopeSpec

# T tokens, H heads, D head_dim, R rotary dims (<= D)


def _default_inv_freq(theta: float, dim: int) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    return 1.0 / (theta**exponents)


def _linear(rope: RopeSpec, dim: int) -> tuple[torch.Tensor, float]:
    return _default_inv_freq(rope.theta, dim) / float(rope.param("factor")), 1.0


def _yarn(rope: RopeSpec, dim: int, max_pos: int) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, extrapolate high ones, ramp between (arXiv 2309.00071)."""
    base, orig = rope.theta, int(rope.param("original_max_position_embeddings"))
    factor = rope.param("factor") or max_pos / orig

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rope.param("attention_factor")
    if attention_factor is None:
        m, m_all = rope.param("mscale"), rope.param("mscale_all_dim")
        both = m and m_all
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if both else mscale(factor)
    beta_fast = rope.param("beta_fast") or 32
    beta_slow = rope.param("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.param("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    extrapolate = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attention_factor)


def _llama3(rope: RopeSpec, dim: int) -> tuple[torch.Tensor, float]:
    """Llama 3.1 scaling: long wavelengths divided by `factor`, short kept, smooth between."""
    inv_freq = _default_inv_freq(rope.theta, dim)
    factor = float(rope.param("factor"))
    low_ff, high_ff = float(rope.param("low_freq_factor")), float(rope.param("high_freq_factor"))
    orig = float(rope.param("original_max_position_embeddings"))
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > orig / low_ff, inv_freq / factor, inv_freq)
    smooth = (orig / wavelen - low_ff) / (high_ff - low_ff)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < orig / high_ff) & ~(wavelen > orig / low_ff)
    return torch.where(medium, smoothed, scaled), 1.0


def inv_freq_and_scale(rope: RopeSpec, max_pos: int) -> tuple[torch.Tensor, float]:
    dim = rope.rotary_dim
    if rope.rope_type == "linear":
        return _linear(rope, dim)
    if rope.rope_type == "yarn":
        return _yarn(rope, dim, max_pos)
    if rope.rope_type == "llama3":
        return _llama3(rope, dim)
    return _default_inv_freq(rope.theta, dim), 1.0


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q [T, Hq, D] and k [T, Hk, D] at `positions` [T]."""

    def __init__(self, spec: ModelSpec, max_positions: int, dtype: torch.dtype) -> None:
        super().__init__()
        inv_freq, scale = inv_freq_and_scale(spec.rope, spec.max_position_embeddings)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_pos, R]
        self.rotary_dim = spec.rope.rotary_dim
        self.register_buffer("cos", (emb.cos() * scale).to(dtype), persistent=False)
        self.register_buffer("sin", (emb.sin() * scale).to(dtype), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, R]
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin, self.rotary_dim), _rotate(k, cos, sin, self.rotary_dim)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, r: int) -> torch.Tensor:
    rot, rest = x[..., :r], x[..., r:]
    half = r // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    out = rot * cos + rotated * sin
    return out if rest.shape[-1] == 0 else torch.cat((out, rest), dim=-1)
