"""Reading whole KV blocks out of a rank's pools and writing them into another rank's pools:
the byte-level half of moving cached KV between engine replicas.

A rank's pool is ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` (its own KV
heads only, so each tensor-parallel rank moves only its own shard). A `BlockShard` holds, for
``n`` blocks, one row of raw bytes per block (all layers, K and V, the layout above with the
block axis first) and the BLAKE2b digest of every row, taken when the bytes were read. Rows are
a numpy array, which Ray carries through its object store without a copy.

Invariants:
- `write_blocks` checks every row's digest (and the reader's verdict, `corrupt`) before it
  writes anything, and writes only the rows that passed; the caller seals nothing past the
  first row that failed;
- a CPU-tier block whose stored checksum (`cache.verify_swaps`) no longer matches its bytes is
  reported in `corrupt` by the reader, never passed off as good.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

DIGEST_SIZE = 16


def block_digest(row: np.ndarray) -> bytes:
    """The checksum of one block's bytes (the same digest `verify_swaps` keeps)."""
    return hashlib.blake2b(row.tobytes(), digest_size=DIGEST_SIZE).digest()


@dataclass
class BlockShard:
    """One rank's bytes of `n` blocks: `rows[i]` is block i's bytes, `checksums[i]` its digest
    when read, `corrupt` the indices the reader found already damaged at the source."""

    rows: np.ndarray
    checksums: list[bytes]
    corrupt: list[int] = field(default_factory=list)

    @property
    def num_bytes(self) -> int:
        return int(self.rows.nbytes)


def read_blocks(
    pool: torch.Tensor, blocks: Sequence[int], stored: Mapping[int, bytes] | None = None
) -> BlockShard:
    """The bytes of `blocks` of `pool`; `stored`: checksums kept for some of them (the CPU
    tier's), checked against what is read."""
    index = torch.tensor(list(blocks), dtype=torch.int64, device=pool.device)
    picked = pool[:, :, index].movedim(2, 0).contiguous().cpu()
    rows = picked.view(torch.uint8).reshape(len(blocks), -1).numpy()
    checksums = [block_digest(row) for row in rows]
    corrupt = []
    if stored:
        for position, block in enumerate(blocks):
            expected = stored.get(block)
            if expected is not None and expected != checksums[position]:
                corrupt.append(position)
    return BlockShard(rows, checksums, corrupt)


def read_from_tiers(
    device_pool: torch.Tensor,
    cpu_pool: torch.Tensor | None,
    sources: Sequence[tuple[str, int]],
    cpu_checksums: Mapping[int, bytes],
) -> BlockShard:
    """`read_blocks` of (tier, block) `sources`, each from its tier's pool, in their order."""
    parts: dict[str, list[int]] = {"device": [], "cpu": []}
    for position, (tier, _) in enumerate(sources):
        if tier not in parts:
            raise ValueError(f"unknown KV tier {tier!r}")
        parts[tier].append(position)
    if parts["cpu"] and cpu_pool is None:
        raise ValueError("CPU-tier blocks asked for but this rank has no CPU pool")
    shards = {
        tier: read_blocks(
            device_pool if tier == "device" else cpu_pool,  # type: ignore[arg-type]
            [sources[p][1] for p in positions],
            cpu_checksums if tier == "cpu" else None,
        )
        for tier, positions in parts.items()
        if positions
    }
    if len(shards) == 1:
        return next(iter(shards.values()))
    width = shards["device"].rows.shape[1]
    rows = np.empty((len(sources), width), dtype=np.uint8)
    checksums: list[bytes] = [b""] * len(sources)
    corrupt: list[int] = []
    for tier, shard in shards.items():
        for at, position in enumerate(parts[tier]):
            rows[position] = shard.rows[at]
            checksums[position] = shard.checksums[at]
        corrupt += [parts[tier][at] for at in shard.corrupt]
    return BlockShard(rows, checksums, sorted(corrupt))


def verified_rows(shard: BlockShard) -> int:
    """How many leading rows of `shard` passed both checks (its bytes match its digest and the
    reader did not find them corrupt)."""
    bad = set(shard.corrupt)
    for position, row in enumerate(shard.rows):
        if position in bad or block_digest(row) != shard.checksums[position]:
            return position
    return len(shard.rows)


def write_blocks(pool: torch.Tensor, blocks: Sequence[int], shard: BlockShard) -> int:
    """Write the verified leading rows of `shard` into `blocks` of `pool`; returns how many."""
    if len(shard.rows) != len(blocks) or len(shard.checksums) != len(blocks):
        raise ValueError(f"{len(shard.rows)} rows for {len(blocks)} blocks")
    per_block = pool[:, :, 0].numel() * pool.element_size()
    if shard.rows.ndim != 2 or shard.rows.shape[1] != per_block:
        raise ValueError(
            f"rows of {shard.rows.shape[1:]} bytes do not fit blocks of {per_block} bytes "
            "(another model, dtype, block size or tensor-parallel split)"
        )
    good = verified_rows(shard)
    if good == 0:
        return 0
    data = torch.from_numpy(np.ascontiguousarray(shard.rows[:good]))
    shape = (good, pool.shape[0], pool.shape[1], *pool.shape[3:])
    values = data.view(pool.dtype).reshape(shape).movedim(0, 2).to(pool.device)
    index = torch.tensor(list(blocks[:good]), dtype=torch.int64, device=pool.device)
    pool[:, :, index] = values
    return good
