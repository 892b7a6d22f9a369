"""SmolLM2-135M-Instruct with PEFT adapters in bfloat16 (what `dtype: auto` runs where bfloat16 is
native) against HF transformers + PEFT in float32: the fast mode's rule, with adapters.

The same adapters as `test_smollm2_parity.py` (built by PEFT on HF's float32 model of the same
GGUF; rank 8 on all seven projections, rank 16 on q/v only). Teacher-forced on HF+PEFT's own
greedy path (every step is fed HF's previous token, so one early flip cannot cascade), each
adapter's prompts and a base-model prompt run in one batch through their LoRA slots; at every
step our logits may move HF's top-2 margin by less than `BFLOAT16_NEAR_TIE` (so a flip is a
near tie), the median move stays below `BFLOAT16_TYPICAL_MOVE`, and flips stay rare. Each
adapter is also checked to change what the base model would choose, so the comparison can fail.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest

from tests.lora.adapters import SMOLLM2_ADAPTERS, Reference
from tests.lora.conftest import SMOLLM2_CHATS, SMOLLM2_NEW_TOKENS, SmolLM2References
from tests.workers.paged_runner import chat_prompt_ids, fast_mode_flips, teacher_forced
from workers import StepPlan, WorkerConfig, WorkerGroup, load_tokenizer
from workers.plan import LoRASlotLoad

pytestmark = pytest.mark.smollm2

NEW_TOKENS = SMOLLM2_NEW_TOKENS
CHATS = SMOLLM2_CHATS
ADAPTERS = SMOLLM2_ADAPTERS


@pytest.fixture(scope="module")
def bf16_lora_group() -> Iterator[WorkerGroup]:
    group = WorkerGroup(
        WorkerConfig(
            model="default",
            dtype="bfloat16",
            backend="local",
            block_size=16,
            num_device_blocks=128,
            max_loras=2,
            max_lora_rank=16,
        )
    )
    yield group
    group.shutdown()


@pytest.fixture(scope="module")
def peft_references(
    smollm2_peft_references: SmolLM2References,
) -> tuple[list[list[int]], SmolLM2References]:
    """The prompts, and per adapter (and "base") its directory and HF's float32 greedy tokens
    and logits for every prompt."""
    return chat_prompt_ids(load_tokenizer("default"), CHATS), smollm2_peft_references


def test_bfloat16_adapters_match_hf_peft_float32_except_near_ties(
    bf16_lora_group: WorkerGroup,
    peft_references: tuple[list[list[int]], dict[str, tuple[pathlib.Path, list[Reference]]]],
) -> None:
    group = bf16_lora_group
    prompts, references = peft_references
    loads = []
    for slot, name in enumerate(ADAPTERS):
        summary = group.add_lora(str(references[name][0]))
        loads.append(LoRASlotLoad(slot, summary.digest, str(references[name][0])))
    group.execute(StepPlan(0, lora_loads=loads))
    cases = [(name, slot) for slot, name in enumerate(ADAPTERS)] + [("base", -1)]
    batch, slots, expected = [], [], []
    for name, slot in cases:
        batch += prompts
        slots += [slot] * len(prompts)
        expected += references[name][1]
    ours = teacher_forced(group, batch, [tokens for tokens, _ in expected], slots)
    flips = fast_mode_flips(expected, ours)
    assert len(flips) <= len(expected) * NEW_TOKENS // 10, flips
    # each adapter changes the greedy path HF's base model takes, so a dropped adapter fails
    base_tokens = [tokens for tokens, _ in references["base"][1]]
    for name in ADAPTERS:
        adapted = [tokens for tokens, _ in references[name][1]]
        assert sum(a != b for a, b in zip(adapted, base_tokens, strict=True)) >= 1, name
