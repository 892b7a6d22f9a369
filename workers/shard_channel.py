"""Moving a `BlockShard` rank to rank over a torch.distributed group: the collective stand-in of
a pull's byte path (NCCL between two TP groups' ranks on GPUs; gloo on CPU, where it is tested).

Holder rank r sends its own shard to the receiver's rank r, and nothing else: a header (rows,
bytes per row, corrupt count), the rows, the digests, the corrupt indices. The receiver rebuilds
the same `BlockShard` and verifies it as any other (`block_io.write_blocks` checks every row's
digest before writing), so the channel needs no trust of its own. On NCCL the tensors would stay
on the device (the digest then taken on a staged CPU copy, or replaced by a device checksum);
this file keeps the CPU layout.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from workers.block_io import DIGEST_SIZE, BlockShard


def send_shard(shard: BlockShard, dst: int, group: dist.ProcessGroup | None = None) -> None:
    rows = np.ascontiguousarray(shard.rows)
    header = torch.tensor([rows.shape[0], rows.shape[1], len(shard.corrupt)], dtype=torch.int64)
    dist.send(header, dst, group=group)
    if rows.shape[0] == 0:
        return
    dist.send(torch.from_numpy(rows), dst, group=group)
    digests = np.frombuffer(b"".join(shard.checksums), dtype=np.uint8).copy()
    dist.send(torch.from_numpy(digests), dst, group=group)
    if shard.corrupt:
        dist.send(torch.tensor(shard.corrupt, dtype=torch.int64), dst, group=group)


def recv_shard(src: int, group: dist.ProcessGroup | None = None) -> BlockShard:
    header = torch.empty(3, dtype=torch.int64)
    dist.recv(header, src, group=group)
    count, width, corrupt_count = (int(v) for v in header)
    if count == 0:
        return BlockShard(np.empty((0, width), dtype=np.uint8), [])
    rows = torch.empty((count, width), dtype=torch.uint8)
    dist.recv(rows, src, group=group)
    digests = torch.empty(count * DIGEST_SIZE, dtype=torch.uint8)
    dist.recv(digests, src, group=group)
    raw = digests.numpy().tobytes()
    checksums = [raw[i * DIGEST_SIZE : (i + 1) * DIGEST_SIZE] for i in range(count)]
    corrupt: list[int] = []
    if corrupt_count:
        indices = torch.empty(corrupt_count, dtype=torch.int64)
        dist.recv(indices, src, group=group)
        corrupt = [int(i) for i in indices]
    return BlockShard(rows.numpy(), checksums, corrupt)
