"""Swapping a sequence's blocks to the CPU tier and back, copying a block, and forking a
sequence leave the next step's logits bit-identical to the run without the round trip."""

from __future__ import annotations

import torch

from workers import SamplingSettings, SequenceWork, StepPlan, WorkerGroup

PROMPT = [11, 23, 5, 8000, 31, 77, 1024, 9, 4, 300, 12, 18, 6]  # 13 tokens: 4 blocks of 4
NEXT = 4242
GREEDY = SamplingSettings(temperature=0.0)


def _decode(group: WorkerGroup, step: int, seq_id: int, **splice: object) -> torch.Tensor:
    """Logits of decoding NEXT at position len(PROMPT) for `seq_id` (idempotent: it rewrites the
    same slot with the same K/V)."""
    work = SequenceWork(seq_id, [NEXT], len(PROMPT), num_samples=1, **splice)  # type: ignore[arg-type]
    _, logits = group.execute_with_logits(StepPlan(step, [work]))
    assert logits is not None
    return logits


def test_swap_out_in_and_copy_keep_logits_bit_identical(tiny_group: WorkerGroup) -> None:
    table = [50, 7, 91, 33]
    prefill = SequenceWork(1, PROMPT, 0, 0, table, 1, sampling=GREEDY)
    tiny_group.execute(StepPlan(100, [prefill]))
    baseline = _decode(tiny_group, 101, 1, table_start=4)

    cpu_blocks = [3, 0, 15, 8]
    swap_out = list(zip(table, cpu_blocks, strict=True))
    tiny_group.execute(StepPlan(102, swap_out=swap_out, released=[1]))
    # Another sequence reuses (and overwrites) the swapped-out device blocks.
    other = SequenceWork(2, list(range(1000, 1016)), 0, 0, table, 1, sampling=GREEDY)
    tiny_group.execute(StepPlan(103, [other]))
    assert not torch.equal(_decode(tiny_group, 104, 2, table_start=4), baseline)

    new_table = [60, 61, 2, 95]
    swap_in = list(zip(cpu_blocks, new_table, strict=True))
    resumed = SequenceWork(1, [NEXT], len(PROMPT), 0, new_table, 1, sampling=GREEDY)
    _, after_swap = tiny_group.execute_with_logits(StepPlan(105, [resumed], swap_in=swap_in))
    assert after_swap is not None and torch.equal(after_swap, baseline)

    # Copy-on-write of the tail block: the copy replaces it in the table.
    tiny_group.execute(StepPlan(106, copy_pairs=[(95, 40)]))
    after_copy = _decode(tiny_group, 107, 1, table_start=3, table_blocks=[40])
    assert torch.equal(after_copy, baseline)
    tiny_group.execute(StepPlan(108, released=[1, 2]))


def test_fork_child_continues_like_its_parent(tiny_group: WorkerGroup) -> None:
    table = [70, 71, 72, 73]
    tiny_group.execute(StepPlan(200, [SequenceWork(5, PROMPT, 0, 0, table, 1, sampling=GREEDY)]))
    parent = _decode(tiny_group, 201, 5, table_start=4)
    tiny_group.execute(StepPlan(202, forks=[(5, 6)], released=[5]))
    child = _decode(tiny_group, 203, 6, table_start=4)
    assert torch.equal(child, parent)
    tiny_group.execute(StepPlan(204, released=[6]))
