"""Each holder rank sends only its own shard to the receiver rank of the same index over gloo
(the collective stand-in of NCCL between two TP groups); the receiver verifies every row and
writes its pool, which then equals the holder's shard exactly; a row damaged after the holder's
digest is refused."""

from __future__ import annotations

import multiprocessing
import pathlib

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pagedserve_kernels import allocate_kv_pool
from workers.block_io import read_blocks, write_blocks
from workers.shard_channel import recv_shard, send_shard

TP = 2
BLOCKS = [5, 1, 6, 2]


def _pool(seed: int) -> torch.Tensor:
    pool = allocate_kv_pool(
        num_layers=2,
        num_blocks=8,
        block_size=4,
        num_kv_heads=1,
        head_dim=32,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    generator = torch.Generator().manual_seed(seed)
    pool.copy_(torch.randn(pool.shape, generator=generator))
    return pool


def _run(rank: int, init: str, results: dict[int, object]) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2 * TP)
    try:
        if rank < TP:  # the holder's rank `rank`: its own KV heads only
            shard = read_blocks(_pool(100 + rank), BLOCKS)
            if rank == 1:
                shard.rows[2, 7] ^= 0x40  # damaged after its digest was taken
            send_shard(shard, rank + TP)
        else:
            holder_rank = rank - TP
            target = torch.zeros_like(_pool(0))
            shard = recv_shard(holder_rank)
            written = write_blocks(target, [0, 1, 2, 3], shard)
            source = _pool(100 + holder_rank)
            same = [torch.equal(target[:, :, i], source[:, :, b]) for i, b in enumerate(BLOCKS)]
            results[rank] = (written, same)
    finally:
        dist.destroy_process_group()


def test_each_rank_moves_its_own_shard_and_damage_is_refused(tmp_path: pathlib.Path) -> None:
    manager = mp.Manager()
    results = manager.dict()
    init = f"file://{tmp_path / 'rendezvous'}"
    # Ranks fork from one forkserver that imported this module once, instead of four spawned
    # interpreters each importing torch and the workers package.
    multiprocessing.get_context("forkserver").set_forkserver_preload([__name__])
    mp.start_processes(
        _run, args=(init, results), nprocs=2 * TP, join=True, start_method="forkserver"
    )
    assert results[TP] == (4, [True, True, True, True])
    assert results[TP + 1] == (2, [True, True, False, False])  # stops at the damaged row
