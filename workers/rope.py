"""Rotary position embeddings (rotate-half layout) with the default, linear, llama3 and yarn rules.

cos/sin are computed per step from the token positions in float32 (no cache to outgrow); the
inverse frequencies follow the published formulas so that the same config gives the same numbers
as the HF reference implementation.
"""

from __future__ import annotations

import math

import torch

from workers.config import RopeSpec


def _default_inv_freq(theta: float, dim: int) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    return 1.0 / (theta**exponents)


def _llama3_inv_freq(rope: RopeSpec, dim: int) -> torch.Tensor:
    inv_freq = _default_inv_freq(rope.theta, dim)
    old_context = rope.original_max_position_embeddings
    low_wavelen = old_context / rope.low_freq_factor
    high_wavelen = old_context / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_context / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(rope: RopeSpec, dim: int) -> torch.Tensor:
    def correction_dim(rotations: float) -> float:
        original = rope.original_max_position_embeddings
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low = max(math.floor(correction_dim(rope.beta_fast)), 0)
    high = min(math.ceil(correction_dim(rope.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (rope.factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor


def inverse_frequencies(rope: RopeSpec, dim: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [dim/2] float32, attention scaling applied to cos and sin)."""
    if rope.kind == "default":
        return _default_inv_freq(rope.theta, dim), 1.0
    if rope.kind == "linear":
        return _default_inv_freq(rope.theta, dim) / rope.factor, 1.0
    if rope.kind == "llama3":
        return _llama3_inv_freq(rope, dim), 1.0
    if rope.kind == "yarn":
        scaling = 1.0 if rope.attention_factor is None else rope.attention_factor
        return _yarn_inv_freq(rope, dim), scaling
    raise ValueError(f"rope kind {rope.kind!r} is not supported")


class RotaryEmbedding(torch.nn.Module):
    """Applies rotary embeddings to packed `[tokens, heads, head_dim]` queries and keys."""

    def __init__(self, rope: RopeSpec, head_dim: int) -> None:
        super().__init__()
        inv_freq, scaling = inverse_frequencies(rope, head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention_scaling = scaling

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos and sin `[tokens, 1, head_dim]` for int `positions [tokens]`, cast to `dtype`."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        cos = (angles.cos() * self.attention_scaling).to(dtype)[:, None, :]
        sin = (angles.sin() * self.attention_scaling).to(dtype)[:, None, :]
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, where rotate_half([a, b]) = [-b, a] over the last dim."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
