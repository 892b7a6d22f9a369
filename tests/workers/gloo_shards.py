"""The rank side of `test_families_gloo`: two processes joined by gloo that run every case's
shard in turn. Kept apart from the test module so each spawned process imports torch and the
workers only (not transformers)."""

from __future__ import annotations

import datetime
import pathlib

import torch
import torch.distributed as dist

from workers.loader import describe_model, load_model_shard
from workers.model import AttentionMetadata
from workers.parallel import TensorParallel, head_layout

PROMPT = list(range(3, 20))
BLOCK_SIZE = 4
GROUP_TIMEOUT = datetime.timedelta(minutes=5)
"""A rank that fails ends the spawn (the other is terminated), so no collective waits this long."""


def _prefill_logits(model: str, cache: str, rank: int, expert_parallel: bool) -> torch.Tensor:
    """The logits of every `PROMPT` position: one prefill of this rank's shard over a paged
    pool."""
    description = describe_model(pathlib.Path(model), pathlib.Path(cache))
    tp = TensorParallel(rank, 2, expert_parallel)
    shard = load_model_shard(
        description, tp, torch.float32, torch.device("cpu"), pathlib.Path(cache)
    )
    spec, tokens = description.spec, len(PROMPT)
    blocks = -(-tokens // BLOCK_SIZE)
    kv_heads = head_layout(spec, tp).num_kv
    pool = torch.zeros(spec.num_layers, 2, blocks, BLOCK_SIZE, kv_heads, spec.head_dim)
    metadata = AttentionMetadata(
        positions=torch.arange(tokens),
        slot_mapping=torch.arange(tokens),
        cu_query_lens=torch.tensor([0, tokens], dtype=torch.int32),
        context_lens=torch.tensor([tokens], dtype=torch.int32),
        block_tables=torch.arange(blocks, dtype=torch.int32)[None],
        logits_indices=torch.arange(tokens),
    )
    return shard.logits(shard(torch.tensor(PROMPT), metadata, pool))


def run_rank(rank: int, cases: list[tuple[str, bool, str]], cache: str, port: int) -> None:
    """`mp.spawn` target: for each (model directory, expert parallel, output file) case, rank
    0 saves its logits to the output file. A failing case raises naming its model."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=GROUP_TIMEOUT,
    )
    try:
        for model, expert_parallel, out in cases:
            try:
                logits = _prefill_logits(model, cache, rank, expert_parallel)
            except Exception as error:
                raise RuntimeError(f"{model} (expert parallel {expert_parallel})") from error
            if rank == 0:
                torch.save(logits, out)
    finally:
        dist.destroy_process_group()
