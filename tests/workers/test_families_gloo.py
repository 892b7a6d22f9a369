"""Every family's TP=2 shards (and the MoE families' expert-parallel shards) in two processes
joined by gloo directly, without Ray: the logits of every prompt position against HF's.

The same sharding the Ray workers run (`load_model_shard` on `TensorParallel(rank, 2)`), one
prefill over a paged pool. Tolerance: 1e-4 absolute.
"""

from __future__ import annotations

import pathlib
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.workers.tiny_families import FAMILY_MODELS, write_family_model
from workers.loader import describe_model, load_model_shard
from workers.model import AttentionMetadata
from workers.parallel import TensorParallel, head_layout

PROMPT = list(range(3, 20))
BLOCK_SIZE = 4
CASES = [(name, False) for name in sorted(FAMILY_MODELS)] + [
    ("mixtral", True),
    ("qwen3_moe", True),
]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _rank(rank: int, model: str, cache: str, expert_parallel: bool, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
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
        logits = shard.logits(shard(torch.tensor(PROMPT), metadata, pool))
        if rank == 0:
            torch.save(logits, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("name", "expert_parallel"), CASES)
def test_two_gloo_ranks_match_hf(name: str, expert_parallel: bool, tmp_path: pathlib.Path) -> None:
    reference = write_family_model(name, tmp_path / name)
    out = tmp_path / "logits.pt"
    arguments = (str(tmp_path / name), str(tmp_path / "cache"), expert_parallel, _free_port())
    mp.spawn(_rank, args=(*arguments, str(out)), nprocs=2)
    with torch.no_grad():
        expected = reference(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(torch.load(out), expected, atol=1e-4, rtol=0)
