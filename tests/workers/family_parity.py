"""Shared pieces of the per-family parity tests: a small worker group over one model, and the
greedy check against HF transformers with the same weights (tokens identical, logits within
1e-4 absolute)."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from tests.workers.paged_runner import greedy_generate, hf_greedy
from workers import WorkerConfig, WorkerGroup

BLOCK_SIZE = 4


@contextmanager
def family_group(
    model: pathlib.Path, cache: pathlib.Path, *, num_device_blocks: int, **settings: Any
) -> Iterator[WorkerGroup]:
    """A `WorkerGroup` over `model` (one in-process rank unless `settings` say otherwise) with
    `num_device_blocks` blocks of `BLOCK_SIZE` tokens, shut down on exit."""
    group = WorkerGroup(
        WorkerConfig(
            model=str(model),
            backend=settings.pop("backend", "local"),
            dtype=settings.pop("dtype", "float32"),
            block_size=BLOCK_SIZE,
            num_device_blocks=num_device_blocks,
            weights_cache_dir=str(cache),
            **settings,
        )
    )
    try:
        yield group
    finally:
        group.shutdown()


def assert_greedy_matches_hf(
    group: WorkerGroup,
    reference: torch.nn.Module,
    prompts: list[list[int]],
    new_tokens: int,
    *,
    seed: int,
    prefill_chunk: int | None = None,
) -> None:
    """`new_tokens` greedy tokens of every prompt through the group's paged KV (prefill in
    chunks of `prefill_chunk`, blocks scattered by `seed`) equal HF's, every step's logits
    within 1e-4."""
    run = greedy_generate(group, prompts, new_tokens, seed=seed, prefill_chunk=prefill_chunk)
    for prompt, tokens, logits in zip(prompts, run.tokens, run.logits, strict=True):
        reference_tokens, reference_logits = hf_greedy(reference, prompt, new_tokens)
        assert tokens == reference_tokens
        torch.testing.assert_close(logits, reference_logits, atol=1e-4, rtol=0)
