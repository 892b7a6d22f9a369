"""Greedy parity of our model with HF transformers on the tiny random Llama (same weights).

Tolerance: logits within 1e-4 absolute (float32, 2 layers); generated tokens identical.
"""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from tests.workers.paged_runner import greedy_generate, hf_greedy
from workers import WorkerGroup

LOGITS_ATOL = 1e-4
NEW_TOKENS = 12


def _prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(49152) for _ in range(rng.randint(3, 21))] for _ in range(count)]


@pytest.mark.parametrize("prefill_chunk", [None, 5])
def test_greedy_tokens_and_logits_match_hf(
    tiny_group: WorkerGroup, tiny_hf: transformers.PreTrainedModel, prefill_chunk: int | None
) -> None:
    prompts = _prompts(4, seed=7)
    run = greedy_generate(tiny_group, prompts, NEW_TOKENS, seed=3, prefill_chunk=prefill_chunk)
    for prompt, tokens, logits in zip(prompts, run.tokens, run.logits, strict=True):
        reference_tokens, reference_logits = hf_greedy(tiny_hf, prompt, NEW_TOKENS)
        assert tokens == reference_tokens
        torch.testing.assert_close(logits, reference_logits, atol=LOGITS_ATOL, rtol=0)


def test_model_info_describes_the_tiny_model(tiny_group: WorkerGroup) -> None:
    info = tiny_group.model_info
    assert (info.architecture, info.num_layers, info.num_heads, info.num_kv_heads) == (
        "llama",
        2,
        4,
        2,
    )
    assert info.head_dim == 32 and info.vocab_size == 49152 and info.max_model_len == 1024
    assert info.kv_bytes_per_block == 2 * 2 * 4 * 2 * 32 * 4
    assert len(info.weights_digest) == 64 and info.quantization == "none"
    assert tiny_group.num_device_blocks == 96 and tiny_group.num_cpu_blocks == 16
