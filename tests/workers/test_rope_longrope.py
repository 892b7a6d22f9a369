"""LongRoPE and partial rotary tables against HF's Phi-3 rotary embedding, on both sides of
the original context (short factors below it, long factors from it on)."""

from __future__ import annotations

import pathlib

import torch

from tests.workers.tiny_families import write_family_model
from workers.model_source import spec_from_hf_directory
from workers.partial_rotary import head_order
from workers.rope import RotaryEmbedding


def test_longrope_partial_tables_match_hf(tmp_path: pathlib.Path) -> None:
    reference = write_family_model("phi3", tmp_path / "phi3")
    spec = spec_from_hf_directory(tmp_path / "phi3")
    assert spec.rope.kind == "longrope" and spec.rope.rotary_dim(spec.head_dim) == 24
    ours = RotaryEmbedding(spec.rope, spec.head_dim)
    original = spec.rope.original_max_position_embeddings
    order = head_order(spec.head_dim, 24)
    probe = torch.zeros(1, 1, spec.hidden_size)
    for position in (0, 5, original - 1, original, original + 7, 300):
        hf_cos, hf_sin = reference.model.rotary_emb(probe, torch.tensor([[position]]))
        cos, sin = ours.cos_sin(torch.tensor([position]), torch.float32)
        # Our stored dimension j holds checkpoint dimension order[j]: rotated ones carry HF's
        # table, the others pass (cos 1, sin 0).
        expected_cos, expected_sin = torch.ones(spec.head_dim), torch.zeros(spec.head_dim)
        rotated = order < 24
        expected_cos[rotated] = hf_cos[0, 0, order[rotated]]
        expected_sin[rotated] = hf_sin[0, 0, order[rotated]]
        torch.testing.assert_close(cos[0, 0], expected_cos, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(sin[0, 0], expected_sin, atol=1e-6, rtol=1e-6)
