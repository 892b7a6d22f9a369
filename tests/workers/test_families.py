"""Greedy parity with HF transformers for every family beyond Llama's, on one rank.

Tiny random models (`tests.workers.tiny_families`); prompts longer than a block and than any
sliding window, prefill in chunks, then batched decodes. Tolerance: logits within 1e-4
absolute, tokens identical.
"""

from __future__ import annotations

import pathlib

import pytest

from tests.workers.family_parity import assert_greedy_matches_hf, family_group
from tests.workers.tiny_families import FAMILY_MODELS, write_family_model

PROMPTS = [list(range(3, 20)), [7, 300, 41, 5, 99, 12, 8, 8, 21]]
NEW_TOKENS = 8


@pytest.mark.parametrize("name", sorted(FAMILY_MODELS))
def test_family_matches_hf(name: str, tmp_path: pathlib.Path) -> None:
    reference = write_family_model(name, tmp_path / name)
    with family_group(tmp_path / name, tmp_path / "cache", num_device_blocks=128) as group:
        assert group.model_info.architecture == name
        assert_greedy_matches_hf(group, reference, PROMPTS, NEW_TOKENS, seed=1, prefill_chunk=5)


def test_sharded_checkpoint_with_tied_embeddings(tmp_path: pathlib.Path) -> None:
    """An HF directory saved in several shards (with its index file) loads as one checkpoint."""
    reference = write_family_model("qwen3", tmp_path / "whole")
    reference.save_pretrained(tmp_path / "sharded", max_shard_size="200KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 2
    with family_group(tmp_path / "sharded", tmp_path / "cache", num_device_blocks=32) as group:
        assert_greedy_matches_hf(group, reference, PROMPTS[:1], 4, seed=1)
