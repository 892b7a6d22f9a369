"""Fixtures of the workers tests: the tiny model as a local group and as the HF reference, and
HF's SmolLM2 greedy references of the teacher-forced parity tests (computed once)."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
import transformers

from workers import WorkerConfig, WorkerGroup

TINY_BLOCK_SIZE = 4
TINY_DEVICE_BLOCKS = 96
SMOLLM2_CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain what a hash table is in one sentence.",
    "Give me a recipe for pancakes.",
    "Why is the sky blue?",
    "Translate 'good morning' into Spanish.",
    "Name two planets of the solar system.",
    "What does a compiler do?",
    "Suggest a name for a black cat.",
]
"""The user messages of the teacher-forced SmolLM2 parity tests (bfloat16, int8 activations)."""
SMOLLM2_NEW_TOKENS = 24


@dataclass(frozen=True)
class ChatReferences:
    """`SMOLLM2_CHATS` as prompt ids (chat template applied) and HF float32's greedy tokens and
    logits `[SMOLLM2_NEW_TOKENS, vocab]` for each."""

    prompts: list[list[int]]
    references: list[tuple[list[int], torch.Tensor]]


@pytest.fixture(scope="session")
def weights_cache(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return tmp_path_factory.mktemp("weights_cache")


@pytest.fixture(scope="module")
def tiny_group(tiny_model_dir: pathlib.Path, weights_cache: pathlib.Path) -> Iterator[WorkerGroup]:
    """The tiny model on one in-process rank: 96 blocks of 4 tokens, 16 CPU swap blocks."""
    group = WorkerGroup(
        WorkerConfig(
            dtype="float32",
            model=str(tiny_model_dir),
            backend="local",
            block_size=TINY_BLOCK_SIZE,
            num_device_blocks=TINY_DEVICE_BLOCKS,
            num_cpu_blocks=16,
            weights_cache_dir=str(weights_cache),
        )
    )
    yield group
    group.shutdown()


@pytest.fixture(scope="session")
def smollm2_chat_references(
    smollm2_hf: transformers.PreTrainedModel, tiny_model_dir: pathlib.Path
) -> ChatReferences:
    """HF float32's greedy run of every `SMOLLM2_CHATS` prompt, the oracle the teacher-forced
    tests share (the tiny model directory holds SmolLM2's tokenizer), all prompts in one batch."""
    from tests.workers.paged_runner import chat_prompt_ids, hf_greedy_batch
    from workers import load_tokenizer

    prompts = chat_prompt_ids(load_tokenizer(str(tiny_model_dir)), SMOLLM2_CHATS)
    return ChatReferences(prompts, hf_greedy_batch(smollm2_hf, prompts, SMOLLM2_NEW_TOKENS))
