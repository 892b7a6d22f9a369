"""Rotary settings of an HF config: `rope_parameters` (or the legacy `rope_theta` and
`rope_scaling`) -> `RopeSpec`."""

from __future__ import annotations

import math
from dataclasses import replace
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
    partial = float(params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)))
    if partial != 1.0:
        return replace(
            rope_from_hf(
                {
                    **config,
                    "partial_rotary_factor": 1.0,
                    "rope_parameters": {**params, "partial_rotary_factor": 1.0},
                }
            ),
            partial_rotary_factor=partial,
        )
    if kind in ("longrope", "su"):
        return _longrope_from_hf(config, params, theta)
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
        f"rope scaling type {kind!r} is not supported "
        "(supported: default, linear, llama3, yarn, longrope)"
    )


def _longrope_from_hf(config: dict[str, Any], params: dict[str, Any], theta: float) -> RopeSpec:
    """LongRoPE (`su`): HF's rules for the factor and the attention factor (from
    `max_position_embeddings / original_max_position_embeddings` unless given)."""
    original = params.get("original_max_position_embeddings")
    original = int(original or config.get("original_max_position_embeddings") or 0)
    if original <= 0:
        raise ValueError("config.json: longrope needs original_max_position_embeddings")
    try:
        short = tuple(float(x) for x in params["short_factor"])
        long = tuple(float(x) for x in params["long_factor"])
    except (KeyError, TypeError) as error:
        raise ValueError(
            "config.json: longrope needs short_factor and long_factor lists"
        ) from error
    factor = params.get("factor")
    factor = float(factor) if factor else int(config.get("max_position_embeddings", 0)) / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    return RopeSpec(
        theta=theta,
        kind="longrope",
        factor=factor,
        original_max_position_embeddings=original,
        attention_factor=float(attention_factor),
        short_factor=short,
        long_factor=long,
    )
