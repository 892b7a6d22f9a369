"""SmolLM2-135M-Instruct with PEFT adapters in bfloat16 (what `make serve` runs) against HF
transformers + PEFT in float32: the fast mode's rule, with adapters.

The same adapters as `test_smollm2_parity.py` (built by PEFT on HF's float32 model of the same
GGUF; rank 8 on all seven projections, rank 16 on q/v only). Teacher-forced on HF+PEFT's own
greedy path (every step is fed HF's previous token, so one early flip cannot cascade), each
adapter's prompts and a base-model prompt run in one batch through their LoRA slots; our greedy
token must equal HF's at every step except where HF's top-2 logit margin is below `NEAR_TIE`,
and such near-tie flips stay rare. Each adapter is also checked to change what the base model
would choose, so the comparison can fail.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest
import torch
import transformers

from tests.lora.adapters import ALL_PROJECTIONS, build_adapter
from tests.workers.conftest import smollm2_hf  # noqa: F401  (the session's HF oracle)
from tests.workers.paged_runner import GREEDY, chat_prompt_ids, hf_greedy, scattered_tables
from workers import SequenceWork, StepPlan, WorkerConfig, WorkerGroup, load_tokenizer
from workers.plan import LoRASlotLoad

NEW_TOKENS = 16
NEAR_TIE = 0.1
CHATS = [
    "What is the capital of France?",
    "List three prime numbers.",
    "Write a haiku about the sea.",
    "Why is the sky blue?",
]
ADAPTERS = {
    "all8": {"rank": 8, "targets": ALL_PROJECTIONS, "seed": 21, "std": 0.04},
    "qv16": {"rank": 16, "targets": ("q_proj", "v_proj"), "seed": 22, "std": 0.06},
}
Reference = tuple[list[int], torch.Tensor]


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
    smollm2_hf: transformers.PreTrainedModel,  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[list[list[int]], dict[str, tuple[pathlib.Path, list[Reference]]]]:
    """The prompts, and per adapter (and "base") its directory and HF's float32 greedy tokens
    and logits for every prompt."""
    prompts = chat_prompt_ids(load_tokenizer("default"), CHATS)
    root = tmp_path_factory.mktemp("smollm2_bf16_adapters")
    out = {}
    for name, spec in ADAPTERS.items():
        model = build_adapter(smollm2_hf, root / name, **spec)  # type: ignore[arg-type]
        try:
            out[name] = (root / name, [hf_greedy(model, p, NEW_TOKENS) for p in prompts])
        finally:
            model.unload()
    out["base"] = (root, [hf_greedy(smollm2_hf, p, NEW_TOKENS) for p in prompts])
    return prompts, out


def teacher_forced_argmax(
    group: WorkerGroup, prompts: list[list[int]], forced: list[list[int]], slots: list[int]
) -> list[list[int]]:
    """Our greedy token at each step when step `k` is fed `forced[i][k - 1]`, prompt i through
    LoRA slot `slots[i]` (-1: the base model)."""
    tables = scattered_tables(
        [len(p) + NEW_TOKENS for p in prompts], group.config.block_size, 128, 7
    )
    ids = list(range(len(prompts)))
    works = [
        SequenceWork(i, prompt, 0, 0, tables[i], 1, sampling=GREEDY, lora_slot=slots[i])
        for i, prompt in enumerate(prompts)
    ]
    output = group.execute(StepPlan(1, works))
    chosen = [[output.samples[i][0].token_id] for i in ids]
    for k in range(1, NEW_TOKENS):
        works = [
            SequenceWork(
                i,
                [forced[i][k - 1]],
                len(prompts[i]) + k - 1,
                len(tables[i]),
                [],
                1,
                output_index=k,
                lora_slot=slots[i],
            )
            for i in ids
        ]
        output = group.execute(StepPlan(k + 1, works))
        for i in ids:
            chosen[i].append(output.samples[i][0].token_id)
    group.execute(StepPlan(NEW_TOKENS + 1, released=ids))
    return chosen


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
    ours = teacher_forced_argmax(group, batch, [tokens for tokens, _ in expected], slots)
    flips = []
    for i, ((tokens, logits), chosen) in enumerate(zip(expected, ours, strict=True)):
        top2 = logits.topk(2, dim=-1).values
        margins = (top2[:, 0] - top2[:, 1]).tolist()
        for k, (want, got) in enumerate(zip(tokens, chosen, strict=True)):
            if want != got:
                flips.append((i, k, margins[k]))
                assert margins[k] < NEAR_TIE, (
                    f"row {i} ({cases[i // len(prompts)][0]}) step {k}: bfloat16 chose {got}, "
                    f"HF+PEFT float32 {want} with margin {margins[k]:.3f} >= {NEAR_TIE}"
                )
    assert len(flips) <= len(expected) * NEW_TOKENS // 10, flips
    # each adapter changes the greedy path HF's base model takes, so a dropped adapter fails
    base_tokens = [tokens for tokens, _ in references["base"][1]]
    for name in ADAPTERS:
        adapted = [tokens for tokens, _ in references[name][1]]
        assert sum(a != b for a, b in zip(adapted, base_tokens, strict=True)) >= 1, name
