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


def kv_groups(group: WorkerGroup) -> int:
    """The block tables per sequence the group's workers expect (hybrid KV groups send them
    interleaved, one entry per group per block: `block_manager.hybrid_state`)."""
    return len(group.model_info.kv_group_windows) or 1


def scattered_tables(
    lengths: list[int], block_size: int, num_blocks: int, seed: int, groups: int = 1
) -> list[list[int]]:
    """Disjoint block tables for sequences of `lengths` tokens, ids shuffled over the pool
    (`groups` entries per block: every group's table is full)."""
    needed = [-(-length // block_size) * groups for length in lengths]
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
    tables = scattered_tables(lengths, block_size, group.num_device_blocks, seed, kv_groups(group))
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
    return hf_greedy_batch(model, [prompt], new_tokens)[0]


def hf_greedy_batch(
    model: torch.nn.Module, prompts: Sequence[list[int]], new_tokens: int, **generate: Any
) -> list[tuple[list[int], torch.Tensor]]:
    """`hf_greedy` of every prompt, run as one left-padded batch (the attention mask hides the
    padding; HF derives each row's positions from it): a decode step reads the weights once for
    all rows, where one prompt at a time reads them once per row. Per prompt: its tokens and
    logits `[new_tokens, vocab]`, equal to its own run's but for float32 summation order.
    `generate`: further arguments of `generate` (PEFT's per-row `adapter_names`)."""
    width = max(len(prompt) for prompt in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    model.generation_config.eos_token_id = None
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=new_tokens,
        min_new_tokens=0,
        do_sample=False,
        pad_token_id=0,
        return_dict_in_generate=True,
        output_logits=True,
        **generate,
    )
    logits = torch.stack(out.logits, dim=1).to(torch.float32)
    return [(out.sequences[row, width:].tolist(), logits[row]) for row in range(len(prompts))]


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


@dataclass
class TeacherForced:
    """Per prompt: our greedy token at each step and our float32 logits `[steps, vocab]`."""

    tokens: list[list[int]] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)

    def __add__(self, other: TeacherForced) -> TeacherForced:
        return TeacherForced(self.tokens + other.tokens, self.logits + other.logits)


def teacher_forced(
    group: WorkerGroup,
    prompts: list[list[int]],
    forced: list[list[int]],
    lora_slots: list[int] | None = None,
) -> TeacherForced:
    """Our greedy token and logits at each step when step `k` is fed `forced[i][k - 1]` (not our
    own), so one early difference cannot cascade; prompt i through LoRA slot `lora_slots[i]`
    (-1 or None: the base model). Block tables are scattered over the pool."""
    steps = len(forced[0])
    slots = lora_slots or [-1] * len(prompts)
    tables = scattered_tables(
        [len(p) + steps for p in prompts],
        group.config.block_size,
        group.num_device_blocks,
        3,
        kv_groups(group),
    )
    ids = list(range(len(prompts)))
    rows: dict[int, list[torch.Tensor]] = {i: [] for i in ids}
    works = [
        SequenceWork(i, prompt, 0, 0, tables[i], 1, sampling=GREEDY, lora_slot=slots[i])
        for i, prompt in enumerate(prompts)
    ]
    samples = _execute(group, StepPlan(1, works), rows)
    chosen = [[samples[i][0].token_id] for i in ids]
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
        samples = _execute(group, StepPlan(k + 1, works), rows)
        for i in ids:
            chosen[i].append(samples[i][0].token_id)
    group.execute(StepPlan(steps + 1, released=ids))
    return TeacherForced(chosen, [torch.stack(rows[i]) for i in ids])


@dataclass(frozen=True)
class Flip:
    """One step of one prompt where our greedy token differs from the reference's."""

    row: int
    step: int
    margin: float  # the reference's top-2 logit margin at that step


def margin_moves(
    references: Sequence[tuple[list[int], torch.Tensor]], ours: TeacherForced
) -> list[list[tuple[int, float, float]]]:
    """Per prompt and step: (the token compared with the reference's greedy one, the reference's
    margin, how far we moved it). The margin
    is the reference's logit of its greedy token minus its logit of our token where we chose
    another, else of its runner-up; the move is |our difference of those two logits - the
    reference's|."""
    moves = []
    for (tokens, hf_logits), chosen, logits in zip(
        references, ours.tokens, ours.logits, strict=True
    ):
        row = []
        runner_up = hf_logits.topk(2, dim=-1).indices[:, 1].tolist()
        for k, (want, got) in enumerate(zip(tokens, chosen, strict=True)):
            other = got if got != want else runner_up[k]
            margin = float(hf_logits[k, want] - hf_logits[k, other])
            ours_margin = float(logits[k, want] - logits[k, other])
            row.append((other, margin, abs(ours_margin - margin)))
        moves.append(row)
    return moves


BFLOAT16_NEAR_TIE = 0.5
"""How far bfloat16 rounding may move a top-2 logit margin of SmolLM2-135M at any step. Moves
measured on the default model reach 0.40 (median 0.03): bfloat16's 8 significand bits in every
layer's weights, products and KV, over 30 layers, with the order of float32 summations inside
the products left to the CPU's kernels (it differs between CPUs with and without native
bfloat16, and with their cache sizes)."""
BFLOAT16_TYPICAL_MOVE = 0.06
"""The median move may not exceed this (measured 0.027-0.036): a check on the bulk of the
steps that a mode rounding more than bfloat16 does (e.g. a bfloat16 residual stream) fails."""


def fast_mode_flips(
    references: Sequence[tuple[list[int], torch.Tensor]],
    ours: TeacherForced,
    near_tie: float = BFLOAT16_NEAR_TIE,
    typical_move: float = BFLOAT16_TYPICAL_MOVE,
) -> list[Flip]:
    """The steps where our greedy token differs from the reference's, checking the fast mode's
    rule at every step: rounding moves the reference's top-2 margin (against our own choice
    where it differs) by less than `near_tie`, so a flip is a decision the reference took by
    less than `near_tie`; and the median move over all steps stays below `typical_move`.
    Raises AssertionError at the first step that breaks the rule."""
    flips = []
    moves = []
    for i, ((tokens, _), row) in enumerate(
        zip(references, margin_moves(references, ours), strict=True)
    ):
        for k, (want, (other, margin, moved)) in enumerate(zip(tokens, row, strict=True)):
            assert moved < near_tie, (
                f"row {i} step {k}: our logits moved the reference's margin of {margin:.3f} "
                f"(token {want} over {other}) by {moved:.3f} >= {near_tie}"
            )
            moves.append(moved)
            if want != ours.tokens[i][k]:
                flips.append(Flip(i, k, margin))
    median = sorted(moves)[len(moves) // 2]
    assert median < typical_move, f"median margin move {median:.3f} >= {typical_move}"
    return flips
