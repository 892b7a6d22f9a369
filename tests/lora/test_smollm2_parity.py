"""SmolLM2-135M-Instruct with PEFT adapters: our float32 path against HF transformers + PEFT.

The adapters are built by PEFT on HF's float32 model of the same GGUF and saved with
`save_pretrained` (rank 8 on all seven projections; rank 16 on q/v only; B drawn at random, so
both change the outputs). Two chat prompts per adapter and one for the base model run in ONE
batch (prefill together, then decode together) through block tables scattered over the pool;
every prompt's greedy tokens must equal HF's `generate(do_sample=False)` with its adapter and
every step's logits lie within the float32 parity tolerance (2e-3).
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest
import torch

from tests.lora.adapters import SMOLLM2_ADAPTERS
from tests.lora.conftest import SMOLLM2_CHATS, SmolLM2References
from tests.workers.paged_runner import chat_prompt_ids, greedy_generate
from workers import StepPlan, WorkerConfig, WorkerGroup, load_tokenizer
from workers.plan import LoRASlotLoad

pytestmark = pytest.mark.smollm2

NEW_TOKENS = 12
LOGITS_ATOL = 2e-3
CHATS = SMOLLM2_CHATS[:2]
ADAPTERS = SMOLLM2_ADAPTERS


@pytest.fixture(scope="module")
def smollm2_lora_group() -> Iterator[WorkerGroup]:
    group = WorkerGroup(
        WorkerConfig(
            dtype="float32",
            model="default",
            backend="local",
            block_size=16,
            num_device_blocks=64,
            max_loras=2,
            max_lora_rank=16,
        )
    )
    yield group
    group.shutdown()


@pytest.fixture(scope="module")
def references(
    smollm2_peft_references: SmolLM2References,
) -> dict[str, tuple[pathlib.Path, list[tuple[list[int], torch.Tensor]]]]:
    """Per adapter: its directory and HF+PEFT's greedy tokens and logits for each chat (the
    session's references, cut to `NEW_TOKENS`)."""
    return {
        name: (
            directory,
            [(tokens[:NEW_TOKENS], logits[:NEW_TOKENS]) for tokens, logits in refs[: len(CHATS)]],
        )
        for name, (directory, refs) in smollm2_peft_references.items()
    }


def test_mixed_batch_matches_hf_peft(
    smollm2_lora_group: WorkerGroup,
    references: dict[str, tuple[pathlib.Path, list[tuple[list[int], torch.Tensor]]]],
) -> None:
    group = smollm2_lora_group
    tokenizer = load_tokenizer("default")
    prompts = chat_prompt_ids(tokenizer, CHATS)
    loads = []
    for slot, name in enumerate(ADAPTERS):
        summary = group.add_lora(str(references[name][0]))
        loads.append(LoRASlotLoad(slot, summary.digest, str(references[name][0])))
    group.execute(StepPlan(0, lora_loads=loads))
    batch = [prompts[0], prompts[1], prompts[0], prompts[1], prompts[0]]
    slots = [0, 0, 1, 1, -1]  # all8, all8, qv16, qv16, base
    run = greedy_generate(group, batch, NEW_TOKENS, seed=5, lora_slots=slots, first_seq_id=100)
    expected = references["all8"][1] + references["qv16"][1] + references["base"][1][:1]
    for index, ((tokens, logits), (ref_tokens, ref_logits)) in enumerate(
        zip(zip(run.tokens, run.logits, strict=True), expected, strict=True)
    ):
        assert tokens == ref_tokens, (index, tokenizer.decode(tokens))
        torch.testing.assert_close(logits, ref_logits, atol=LOGITS_ATOL, rtol=0)
    # each adapter changes what the base model computes (so the comparison above can fail)
    base = references["base"][1]
    changed_tokens = 0
    for adapted in (expected[0:2], expected[2:4]):
        for (tokens, logits), (base_tokens, base_logits) in zip(adapted, base, strict=True):
            assert (logits[0] - base_logits[0]).abs().max() > 0.5
            changed_tokens += tokens != base_tokens
    assert changed_tokens >= 2
