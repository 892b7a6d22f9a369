"""Every family beyond Llama's at TP=2 on CPU (two Ray actors joined by gloo) against HF;
the mixture-of-experts ones also with expert parallelism (whole experts per rank).

Tolerance: logits within 1e-4 absolute (the all-reduces sum partial products in another
order); greedy tokens identical.
"""

from __future__ import annotations

import pathlib

import pytest
import torch

from tests.workers.paged_runner import greedy_generate, hf_greedy
from tests.workers.tiny_families import FAMILY_MODELS, write_family_model
from workers import WorkerConfig, WorkerGroup

PROMPTS = [list(range(3, 20)), [42, 7, 300]]
NEW_TOKENS = 6


CASES = [(name, False) for name in sorted(FAMILY_MODELS)] + [
    ("mixtral", True),
    ("qwen3_moe", True),
]


@pytest.mark.parametrize(("name", "expert_parallel"), CASES)
def test_family_tp2_matches_hf(
    ray_cluster: None, name: str, expert_parallel: bool, tmp_path: pathlib.Path
) -> None:
    reference = write_family_model(name, tmp_path / name)
    group = WorkerGroup(
        WorkerConfig(
            model=str(tmp_path / name),
            backend="ray",
            tensor_parallel_size=2,
            enable_expert_parallel=expert_parallel,
            block_size=4,
            num_device_blocks=48,
            weights_cache_dir=str(tmp_path / "cache"),
        )
    )
    try:
        run = greedy_generate(group, PROMPTS, NEW_TOKENS, seed=3, prefill_chunk=6)
        for prompt, tokens, logits in zip(PROMPTS, run.tokens, run.logits, strict=True):
            reference_tokens, reference_logits = hf_greedy(reference, prompt, NEW_TOKENS)
            assert tokens == reference_tokens
            torch.testing.assert_close(logits, reference_logits, atol=1e-4, rtol=0)
    finally:
        group.shutdown()
