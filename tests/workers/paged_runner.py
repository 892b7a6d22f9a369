"""Drive a `WorkerGroup` like an engine would, with block tables scattered over the pool.

Used by the parity tests: batched (optionally chunked) prefill of several prompts in one step,
then batched greedy decode steps, recording every step's logits.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from workers import SampledToken, SamplingSettings, SequenceWork, StepPlan, WorkerGroup

GREEDY = SamplingSettings(temperature=0.0)


def scattered_tables(
    lengths: list[int], block_size: int, num_blocks: int, seed: int
) -> list[list[int]]:
    """Disjoint block tables for sequences of `lengths` tokens, ids shuffled over the pool."""
    needed = [-(-length // block_size) for length in lengths]
    if sum(needed) > num_blocks:
        raise ValueError(f"{sum(needed)} blocks needed, the pool has {num_blocks}")
    ids = list(range(num_blocks))
    random.Random(seed).shuffle(ids)
    tables, start = [], 0
    for count in needed:
        tables.append(ids[start : start + count])
        start += count
    return tables


@dataclass
class GreedyRun:
    """Generated tokens per prompt and, per prompt, the logits `[new_tokens, vocab]`."""

    tokens: list[list[int]] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)


def _execute(
    group: WorkerGroup, plan: StepPlan, rows: dict[int, list[torch.Tensor]]
) -> dict[int, list[SampledToken]]:
    """Run `plan`, file each sampled row's logits under its prompt index; returns the samples."""
    output, logits = group.execute_with_logits(plan)
    sampled = [work.seq_id for work in plan.sequences if work.num_samples > 0]
    if sampled:
        assert logits is not None and logits.shape[0] == len(sampled)
        for row, seq_id in enumerate(sampled):
            rows[seq_id].append(logits[row])
    return output.samples


def greedy_generate(
    group: WorkerGroup,
    prompts: list[list[int]],
    new_tokens: int,
    *,
    seed: int = 0,
    prefill_chunk: int | None = None,
    first_seq_id: int = 0,
    lora_slots: Sequence[int] | None = None,
) -> GreedyRun:
    """Generate `new_tokens` greedy tokens for every prompt through paged KV, then release them.
    `lora_slots`: each prompt's LoRA slot (-1: none; the slots must be filled already)."""
    slots = list(lora_slots) if lora_slots is not None else [-1] * len(prompts)
    block_size = group.config.block_size
    lengths = [len(p) + new_tokens for p in prompts]
    tables = scattered_tables(lengths, block_size, group.num_device_blocks, seed)
    seq_ids = [first_seq_id + i for i in range(len(prompts))]
    tokens: list[list[int]] = [[] for _ in prompts]
    rows: dict[int, list[torch.Tensor]] = {seq_id: [] for seq_id in seq_ids}
    step = 0
    chunk = prefill_chunk or max(len(p) for p in prompts)
    done = [0] * len(prompts)
    while any(done[i] < len(p) for i, p in enumerate(prompts)):
        works = []
        for i, prompt in enumerate(prompts):
            if done[i] >= len(prompt):
                continue
            piece = prompt[done[i] : done[i] + chunk]
            first = done[i] == 0
            final = done[i] + len(piece) == len(prompt)
            works.append(
                SequenceWork(
                    seq_id=seq_ids[i],
                    token_ids=piece,
                    start_pos=done[i],
                    table_start=0 if first else len(tables[i]),
                    table_blocks=tables[i] if first else [],
                    num_samples=1 if final else 0,
                    sampling=GREEDY if first else None,
                    lora_slot=slots[i],
                )
            )
            done[i] += len(piece)
        samples = _execute(group, StepPlan(step, works), rows)
        step += 1
        for i in range(len(prompts)):
            if seq_ids[i] in samples:
                tokens[i].append(samples[seq_ids[i]][0].token_id)
    for index in range(1, new_tokens):
        works = [
            SequenceWork(
                seq_id=seq_ids[i],
                token_ids=[tokens[i][-1]],
                start_pos=len(prompt) + index - 1,
                table_start=len(tables[i]),
                num_samples=1,
                output_index=index,
                lora_slot=slots[i],
            )
            for i, prompt in enumerate(prompts)
        ]
        samples = _execute(group, StepPlan(step, works), rows)
        step += 1
        for i in range(len(prompts)):
            tokens[i].append(samples[seq_ids[i]][0].token_id)
    group.execute(StepPlan(step, released=seq_ids))
    return GreedyRun(tokens, [torch.stack(rows[seq_id]) for seq_id in seq_ids])


def hf_greedy(
    model: torch.nn.Module, prompt: list[int], new_tokens: int
) -> tuple[list[int], torch.Tensor]:
    """HF `generate(do_sample=False)` for exactly `new_tokens` tokens (EOS does not stop it):
    the tokens and the raw logits `[new_tokens, vocab]` of every step."""
    model.generation_config.eos_token_id = None
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
        max_new_tokens=new_tokens,
        min_new_tokens=0,
        do_sample=False,
        pad_token_id=0,
        return_dict_in_generate=True,
        output_logits=True,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    return tokens, torch.cat(out.logits, dim=0).to(torch.float32)


def chat_prompt_ids(tokenizer: Any, chats: Sequence[str]) -> list[list[int]]:
    """Each user message rendered with the model's chat template and tokenized as the engine
    does for chat (the template writes the special tokens itself)."""
    return [
        tokenizer(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": chat}], add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        )["input_ids"]
        for chat in chats
    ]


def teacher_forced_argmax(
    group: WorkerGroup,
    prompts: list[list[int]],
    forced: list[list[int]],
    lora_slots: list[int] | None = None,
) -> list[list[int]]:
    """Our greedy token at each step when step `k` is fed `forced[i][k - 1]` (not our own), so
    one early difference cannot cascade; prompt i through LoRA slot `lora_slots[i]` (-1 or
    None: the base model). Block tables are scattered over the pool."""
    steps = len(forced[0])
    slots = lora_slots or [-1] * len(prompts)
    tables = scattered_tables(
        [len(p) + steps for p in prompts], group.config.block_size, group.num_device_blocks, 3
    )
    ids = list(range(len(prompts)))
    works = [
        SequenceWork(i, prompt, 0, 0, tables[i], 1, sampling=GREEDY, lora_slot=slots[i])
        for i, prompt in enumerate(prompts)
    ]
    output = group.execute(StepPlan(1, works))
    chosen = [[output.samples[i][0].token_id] for i in ids]
    for k in range(1, steps):
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
    group.execute(StepPlan(steps + 1, released=ids))
    return chosen


def near_tie_flips(
    references: Sequence[tuple[list[int], torch.Tensor]],
    ours: Sequence[list[int]],
    near_tie: float,
) -> list[tuple[int, int, float]]:
    """(row, step, HF's top-2 margin) of every step where our token differs from HF's greedy
    one; raises AssertionError at a flip whose margin is not below `near_tie` (a decision the
    reference did not nearly tie on)."""
    flips = []
    for i, ((tokens, logits), chosen) in enumerate(zip(references, ours, strict=True)):
        top2 = logits.topk(2, dim=-1).values
        margins = (top2[:, 0] - top2[:, 1]).tolist()
        for k, (want, got) in enumerate(zip(tokens, chosen, strict=True)):
            if want != got:
                flips.append((i, k, margins[k]))
                assert margins[k] < near_tie, (
                    f"row {i} step {k}: we chose {got}, the reference {want} with margin "
                    f"{margins[k]:.3f} >= {near_tie}"
                )
    return flips
