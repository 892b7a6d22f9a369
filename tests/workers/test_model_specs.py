"""Model descriptions read from HF config.json variants (pure parsing, no weights)."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest

from workers.model_source import spec_from_hf_directory

BASE: dict[str, Any] = {
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 2,
    "max_position_embeddings": 128,
}


def _spec(tmp_path: pathlib.Path, **config: Any) -> Any:
    (tmp_path / "config.json").write_text(json.dumps({**BASE, **config}))
    return spec_from_hf_directory(tmp_path)


def test_qwen2_sliding_window_applies_from_max_window_layers(tmp_path: pathlib.Path) -> None:
    spec = _spec(
        tmp_path,
        architectures=["Qwen2ForCausalLM"],
        use_sliding_window=True,
        sliding_window=32,
        max_window_layers=1,
    )
    assert spec.layer_sliding_windows == (None, 32, 32)
    assert spec.attention_bias and spec.sliding_window == 32
    off = _spec(tmp_path, architectures=["Qwen2ForCausalLM"], sliding_window=32)
    assert off.layer_sliding_windows == (None, None, None)


def test_layer_types_choose_sliding_layers(tmp_path: pathlib.Path) -> None:
    spec = _spec(
        tmp_path,
        model_type="mistral",
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    )
    assert spec.layer_sliding_windows == (16, None, 16)


def test_legacy_rope_scaling_and_defaults(tmp_path: pathlib.Path) -> None:
    spec = _spec(
        tmp_path,
        model_type="llama",
        rope_theta=500000.0,
        rope_scaling={"type": "linear", "factor": 4.0},
        eos_token_id=[2, 7],
    )
    assert (spec.rope.kind, spec.rope.factor, spec.rope.theta) == ("linear", 4.0, 500000.0)
    assert spec.num_kv_heads == 2 and spec.head_dim == 32 and spec.eos_token_ids == (2, 7)
    with pytest.raises(ValueError, match="rope scaling type 'dynamic' is not supported"):
        _spec(tmp_path, model_type="llama", rope_scaling={"type": "dynamic", "factor": 2.0})


def test_inconsistent_head_counts_are_named(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match=r"num_attention_heads \(2\) must be a multiple of"):
        _spec(tmp_path, model_type="llama", num_key_value_heads=3)
    with pytest.raises(ValueError, match="hidden_act 'gelu' is not supported"):
        _spec(tmp_path, model_type="llama", hidden_act="gelu")
