"""Rotary position embeddings (rotate-half layout): default, linear, llama3, yarn and longrope
rules, over all of a head or its leading `RopeSpec.rotary_dim` dimensions.

cos/sin are computed per step from the token positions in float32 (no cache to outgrow); the
inverse frequencies follow the published formulas so that the same config gives the same numbers
as the HF reference implementation.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

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


def _longrope_inv_freq(rope: RopeSpec, dim: int, factors: tuple[float, ...]) -> torch.Tensor:
    if len(factors) != dim // 2:
        raise ValueError(
            f"longrope short_factor and long_factor need {dim // 2} entries "
            f"(rotary dim {dim} / 2), got {len(rope.short_factor)} and {len(rope.long_factor)}"
        )
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * rope.theta**exponents)


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
    if rope.kind == "longrope":
        scaling = 1.0 if rope.attention_factor is None else rope.attention_factor
        return _longrope_inv_freq(rope, dim, rope.short_factor), scaling
    raise ValueError(f"rope kind {rope.kind!r} is not supported")


class RotaryEmbedding(torch.nn.Module):
    """Applies rotary embeddings to packed `[tokens, heads, head_dim]` queries and keys.

    A partial rotary (`rotary_dim < head_dim`) works on heads whose dimensions were reordered at
    load (`workers.partial_rotary`): the rotated pairs are `(j, j + head_dim / 2)` for
    `j < rotary_dim / 2`, and the other columns get cos 1 and sin 0 (they pass unchanged).
    longrope uses the long factors from position `original_max_position_embeddings` on: a
    token's own position decides, and cached keys keep their rotation. (HF recomputes a whole
    sequence with the long factors once it outgrows the original context; both agree on every
    sequence within it.)
    """

    def __init__(self, rope: RopeSpec, head_dim: int) -> None:
        super().__init__()
        rotary_dim = rope.rotary_dim(head_dim)
        if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
            raise ValueError(
                f"partial_rotary_factor {rope.partial_rotary_factor} gives rotary dim "
                f"{rotary_dim} for head_dim {head_dim}: it must be positive, even and at most "
                "head_dim"
            )
        inv_freq, scaling = inverse_frequencies(rope, rotary_dim)
        pad = (head_dim - rotary_dim) // 2
        self.register_buffer("inv_freq", F.pad(inv_freq, (0, pad)), persistent=False)
        long_inv_freq = None
        if rope.kind == "longrope":
            long_inv_freq = F.pad(_longrope_inv_freq(rope, rotary_dim, rope.long_factor), (0, pad))
        self.register_buffer("long_inv_freq", long_inv_freq, persistent=False)
        self.long_from = rope.original_max_position_embeddings
        self.attention_scaling = scaling
        passing = torch.zeros(head_dim, dtype=torch.bool)
        passing[rotary_dim // 2 : head_dim // 2] = True
        passing[head_dim // 2 + rotary_dim // 2 :] = True
        self.passing: torch.Tensor | None = passing if pad else None

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos and sin `[tokens, 1, head_dim]` for int `positions [tokens]`, cast to `dtype`."""
        at = positions.to(torch.float32)[:, None]
        freqs = at * self.inv_freq[None, :]
        if self.long_inv_freq is not None:
            long = (positions >= self.long_from)[:, None]
            freqs = torch.where(long, at * self.long_inv_freq[None, :], freqs)
        angles = torch.cat((freqs, freqs), dim=-1)
        cos = angles.cos() * self.attention_scaling
        sin = angles.sin() * self.attention_scaling
        if self.passing is not None:
            cos = cos.masked_fill(self.passing.to(cos.device), 1.0)
            sin = sin.masked_fill(self.passing.to(sin.device), 0.0)
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, where rotate_half([a, b]) = [-b, a] over the last dim."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
