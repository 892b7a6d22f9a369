"""Greedy parity with HF transformers for every family beyond Llama's, on one rank.

Tiny random models (`tests.workers.tiny_families`); prompts longer than a block and than any
sliding window, prefill in chunks, then batched decodes. Tolerance: logits within 1e-4
absolute, tokens identical.
"""

from __future__ import annotations

import pathlib

import pytest
import torch

from tests.workers.paged_runner import greedy_generate, hf_greedy
from tests.workers.tiny_families import FAMILY_MODELS, write_family_model
from workers import WorkerConfig, WorkerGroup

PROMPTS = [list(range(3, 20)), [7, 300, 41, 5, 99, 12, 8, 8, 21]]
NEW_TOKENS = 8


@pytest.mark.parametrize("name", sorted(FAMILY_MODELS))
def test_family_matches_hf(name: str, tmp_path: pathlib.Path) -> None:
    reference = write_family_model(name, tmp_path / name)
    group = WorkerGroup(
        WorkerConfig(
            model=str(tmp_path / name),
            backend="local",
            block_size=4,
            num_device_blocks=64,
            weights_cache_dir=str(tmp_path / "cache"),
        )
    )
    try:
        assert group.model_info.architecture == name
        run = greedy_generate(group, PROMPTS, NEW_TOKENS, seed=1, prefill_chunk=5)
        for prompt, tokens, logits in zip(PROMPTS, run.tokens, run.logits, strict=True):
            reference_tokens, reference_logits = hf_greedy(reference, prompt, NEW_TOKENS)
            assert tokens == reference_tokens
            torch.testing.assert_close(logits, reference_logits, atol=1e-4, rtol=0)
    finally:
        group.shutdown()


def test_sharded_checkpoint_with_tied_embeddings(tmp_path: pathlib.Path) -> None:
    """An HF directory saved in several shards (with its index file) loads as one checkpoint."""
    reference = write_family_model("qwen3", tmp_path / "whole")
    reference.save_pretrained(tmp_path / "sharded", max_shard_size="200KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 2
    group = WorkerGroup(
        WorkerConfig(
            model=str(tmp_path / "sharded"),
            backend="local",
            block_size=4,
            num_device_blocks=32,
            weights_cache_dir=str(tmp_path / "cache"),
        )
    )
    try:
        run = greedy_generate(group, PROMPTS[:1], 4, seed=1)
        tokens, logits = hf_greedy(reference, PROMPTS[0], 4)
        assert run.tokens[0] == tokens
        torch.testing.assert_close(run.logits[0], logits, atol=1e-4, rtol=0)
    finally:
        group.shutdown()
