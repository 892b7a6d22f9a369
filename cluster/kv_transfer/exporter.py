"""The holder's side of a pull: `KVExporter.export_blocks(block_keys)`.

It pins the leading run of the keys this replica holds (`TransferLeases.pin_export`: device
first, else the CPU cache tier), has every rank read its shard of them, records each block's
generation when pinned and after the read (a block that changed meanwhile, or lost its key,
gets a different "after", so the receiver stops at it), and releases the pins, after the read
and on every failure (cancellation included). The answer is always a leading run of exactly
the keys asked for.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from cluster.kv_transfer.metrics import TransferCounters
from cluster.kv_transfer.payload import ExportedBlock, KVPayload


class KVExporter:
    """`core`: the replica's `EngineCore` (its block manager must be the paged one)."""

    def __init__(self, replica_id: str, core: Any, counters: TransferCounters) -> None:
        self.replica_id = replica_id
        self.core = core
        self.counters = counters

    async def export_blocks(self, block_keys: Sequence[bytes]) -> KVPayload:
        leases = self.core.block_manager.transfer_leases
        lease = leases.pin_export(list(block_keys))
        try:
            if not lease.blocks:
                return KVPayload(self.replica_id)
            began = time.perf_counter()
            shards = await self.core.workers.read_blocks_async(
                [(pinned.tier, pinned.block) for pinned in lease.blocks]
            )
            read_seconds = time.perf_counter() - began
            now = leases.generations_now(lease.lease_id)
            for index in leases.changed(lease.lease_id):  # unsealed, or reused: never current
                if now[index] == lease.blocks[index].generation:
                    now[index] = -1
            blocks = [
                ExportedBlock(pinned.block_hash, pinned.tier, pinned.generation, after)
                for pinned, after in zip(lease.blocks, now, strict=True)
            ]
            payload = KVPayload(self.replica_id, blocks, shards, read_seconds)
        finally:
            leases.release(lease.lease_id)
        self.counters.exports += 1
        self.counters.exported_blocks += len(payload.blocks)
        self.counters.exported_bytes += payload.num_bytes
        return payload
