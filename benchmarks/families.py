"""Decode and prefill tokens/s of each model family on tiny random models (CPU, float32).

The models are the parity tests' (`benchmarks.tiny_models`, a 128-wide 2-7 layer decoder
per family): the figures compare families' per-token overheads against each other, not real
model sizes. Each family runs on one in-process rank at batch 1 and 16, best of `repeats`
after a warm-up.
"""

from __future__ import annotations

import pathlib
import tempfile
import time
from typing import Any

import torch

from benchmarks.tiny_models import FAMILY_MODELS, write_family_model
from workers import SamplingSettings, SequenceWork, StepPlan, WorkerConfig, WorkerGroup

BATCHES = (1, 16)
GREEDY = SamplingSettings(temperature=0.0)


def _measure(group: WorkerGroup, batch: int, prompt_len: int, steps: int) -> tuple[float, float]:
    """(prefill, decode) seconds of one round: `batch` prompts, then `steps` decode steps."""
    blocks = -(-(prompt_len + steps + 1) // group.config.block_size)
    prefill = [
        SequenceWork(
            seq_id=i,
            token_ids=[(7 * i + j) % 500 + 3 for j in range(prompt_len)],
            start_pos=0,
            table_start=0,
            table_blocks=list(range(i * blocks, (i + 1) * blocks)),
            num_samples=1,
            sampling=GREEDY,
        )
        for i in range(batch)
    ]
    began = time.perf_counter()
    group.execute(StepPlan(0, prefill))
    prefilled = time.perf_counter()
    for k in range(steps):
        works = [SequenceWork(i, [42], prompt_len + k, blocks, [], 1) for i in range(batch)]
        group.execute(StepPlan(k + 1, works))
    decoded = time.perf_counter()
    group.execute(StepPlan(steps + 1, [], released=list(range(batch))))
    return prefilled - began, decoded - prefilled


def family_throughput(prompt_len: int, steps: int, repeats: int) -> dict[str, Any]:
    """{family: {"prefill": {batch: tok/s}, "decode": {batch: tok/s}}} for every family."""
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as scratch:
        root = pathlib.Path(scratch)
        for name in sorted(FAMILY_MODELS):
            write_family_model(name, root / name)
            blocks = max(BATCHES) * -(-(prompt_len + steps + 1) // 16) + 8
            group = WorkerGroup(
                WorkerConfig(
                    dtype="float32",
                    model=str(root / name),
                    backend="local",
                    block_size=16,
                    num_device_blocks=blocks,
                    num_cpu_blocks=1,
                    num_threads=torch.get_num_threads(),
                    weights_cache_dir=str(root / "cache"),
                )
            )
            try:
                family: dict[str, dict[int, float]] = {"prefill": {}, "decode": {}}
                for batch in BATCHES:
                    rounds = [_measure(group, batch, prompt_len, steps) for _ in range(repeats + 1)]
                    prefill = min(r[0] for r in rounds[1:])
                    decode = min(r[1] for r in rounds[1:])
                    family["prefill"][batch] = round(batch * prompt_len / prefill, 1)
                    family["decode"][batch] = round(batch * steps / decode, 1)
                results[name] = family
            finally:
                group.shutdown()
    return results
