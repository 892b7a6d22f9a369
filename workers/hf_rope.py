"""Rotary settings of an HF config: `rope_parameters` (or the legacy `rope_theta` and
`rope_scaling`) -> `RopeSpec`."""

from __future__ import annotations

import math
from typing import Any

from workers.config import RopeSpec


def rope_from_hf(config: dict[str, Any]) -> RopeSpec:
    """Rope settings of an HF config (`rope_parameters`, or legacy `rope_theta`, `rope_scaling`)."""
    params = dict(config.get("rope_parameters") or {})
    scaling = dict(config.get("rope_scaling") or {})
    params = {**scaling, **params}
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    kind = str(params.get("rope_type", params.get("type", "default")) or "default")
    original = int(
        params.get("original_max_position_embeddings", config.get("max_position_embeddings", 0))
    )
    factor = float(params.get("factor", 1.0))
    if kind == "default":
        return RopeSpec(theta=theta)
    if kind == "linear":
        return RopeSpec(theta=theta, kind="linear", factor=factor)
    if kind == "llama3":
        return RopeSpec(
            theta=theta,
            kind="llama3",
            factor=factor,
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=original,
        )
    if kind == "yarn":
        attention_factor = params.get("attention_factor")
        return RopeSpec(
            theta=theta,
            kind="yarn",
            factor=factor,
            original_max_position_embeddings=original,
            beta_fast=float(params.get("beta_fast", 32.0)),
            beta_slow=float(params.get("beta_slow", 1.0)),
            attention_factor=(
                float(attention_factor)
                if attention_factor is not None
                else 0.1 * math.log(factor) + 1.0
                if factor > 1
                else 1.0
            ),
        )
    raise ValueError(
        f"rope scaling type {kind!r} is not supported (supported: default, linear, llama3, yarn)"
    )
