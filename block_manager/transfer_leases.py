"""Leases on KV blocks that move between engine replicas (a peer pulling a cached prefix).

Both ends of a transfer hold their blocks through a lease, so nothing a copy reads or writes is
reused while the copy is in flight, and every lease ends with `release`, after the copy and on
every failure alike:

- **Holder** (`pin_export`): the receiver names the blocks by their exact hash preimages (its own
  cache keys for the request, so a block of a replica with another identity, adapter or tenant
  can never match). The leading run of keys held here, each on the device or else in the CPU
  cache tier (a CPU copy whose generation moved since it was copied in counts as not held), is
  pinned (one reference each) with the generation of every block; `changed(lease)` then tells
  which blocks no longer hold the same key at the same generation (discarded, or a bug), so a
  stale block is never sent.
- **Receiver** (`reserve_import`): fresh device blocks leave the free queue (reference 1,
  unsealed, the watermark kept; cached ones they evict are dropped, not demoted to the CPU
  tier, since the pulled bytes may land before a demotion's copy would run) for the pulled
  bytes to land in; `seal_import` then seals a
  leading run of them under the receiver's own keys, in chain order. A key that got sealed
  locally meanwhile (the same prefix computed here) keeps the local block; the reserved one goes
  back unsealed. Releasing the lease leaves the sealed blocks cached (findable by the next
  lookup), the others free.

`pinned_refs()` reports every reference the leases hold, so `check_integrity` counts them like
the CPU tier's in-flight pins.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from block_manager.errors import InvalidOperation, Tier
from block_manager.pool import BlockPool
from block_manager.tiers import CpuTier


@dataclass(frozen=True)
class PinnedBlock:
    """One block a lease holds: where it lives, its id there, its generation when pinned."""

    tier: Tier
    block: int
    generation: int
    block_hash: bytes


@dataclass
class TransferLease:
    """Blocks held for one transfer (`kind` "export" on the holder, "import" on the receiver)."""

    lease_id: int
    kind: str
    blocks: list[PinnedBlock] = field(default_factory=list)
    sealed: int = 0
    """Import leases: how many leading blocks `seal_import` sealed."""


class TransferLeases:
    """The leases of one block manager (see the module doc). Not thread-safe, like the manager."""

    __slots__ = ("_cpu", "_device", "_ids", "_leases", "_tier", "_watermark")

    def __init__(
        self, device: BlockPool, cpu: BlockPool, tier: CpuTier | None, watermark_blocks: int
    ) -> None:
        self._device = device
        self._cpu = cpu
        self._tier = tier
        self._watermark = watermark_blocks
        self._ids = itertools.count(1)
        self._leases: dict[int, TransferLease] = {}

    def _pool(self, tier: Tier) -> BlockPool:
        return self._device if tier == "device" else self._cpu

    # --- holder side
    def pin_export(self, block_keys: Sequence[bytes]) -> TransferLease:
        """Pin the leading run of `block_keys` held here (device first, else the CPU tier)."""
        lease = TransferLease(next(self._ids), "export")
        device, cpu, tier = self._device, self._cpu, self._tier
        for key in block_keys:
            block = device.cached.get(key)
            where: Tier = "device"
            if block is None:
                block = cpu.cached.get(key)
                where = "cpu"
                if block is None or (
                    tier is not None and cpu.generations[block] != tier.copied_at[block]
                ):
                    break
            pool = device if where == "device" else cpu
            pool.acquire(block)
            digest = pool.hashes[block]
            assert digest is not None
            lease.blocks.append(PinnedBlock(where, block, pool.generations[block], digest))
        self._leases[lease.lease_id] = lease
        return lease

    def changed(self, lease_id: int) -> list[int]:
        """Indices of the lease's blocks that no longer hold their key at their generation."""
        lease = self._get(lease_id)
        stale = []
        for index, pinned in enumerate(lease.blocks):
            pool = self._pool(pinned.tier)
            if (
                pool.hashes[pinned.block] != pinned.block_hash
                or pool.generations[pinned.block] != pinned.generation
            ):
                stale.append(index)
        return stale

    def generations_now(self, lease_id: int) -> list[int]:
        """The current generation of each of the lease's blocks (in lease order)."""
        return [self._pool(p.tier).generations[p.block] for p in self._get(lease_id).blocks]

    # --- receiver side
    def reserve_import(self, count: int) -> TransferLease:
        """`count` fresh device blocks for pulled KV to land in; NoFreeBlocks (nothing taken)
        when fewer than `count` are free beyond the watermark."""
        device = self._device
        device.require_free(count, self._watermark, f"cannot reserve {count} blocks for a KV pull")
        lease = TransferLease(next(self._ids), "import")
        # No demotion of the cached blocks this evicts: a demotion's copy runs with the next
        # step, and the pulled bytes may land before it (it would save them under the old key).
        on_evict, device.on_evict = device.on_evict, None
        try:
            taken = device.pop_many(count)
        finally:
            device.on_evict = on_evict
        for block in taken:
            lease.blocks.append(PinnedBlock("device", block, device.generations[block], b""))
        self._leases[lease.lease_id] = lease
        return lease

    def seal_import(self, lease_id: int, block_keys: Sequence[bytes]) -> int:
        """Seal the lease's first ``len(block_keys)`` blocks, in order, under `block_keys` (the
        blocks' bytes have landed); returns how many of the chain are now cached here."""
        lease = self._get(lease_id)
        if lease.kind != "import" or lease.sealed or len(block_keys) > len(lease.blocks):
            raise InvalidOperation(
                f"lease {lease_id} cannot seal {len(block_keys)} blocks "
                f"({lease.kind}, {len(lease.blocks)} blocks, {lease.sealed} sealed)"
            )
        device = self._device
        for index, key in enumerate(block_keys):
            pinned = lease.blocks[index]
            digest = hashlib.sha256(key).digest()
            if key not in device.cached:
                device.seal(pinned.block, key, digest)
            lease.blocks[index] = PinnedBlock("device", pinned.block, pinned.generation, digest)
        lease.sealed = len(block_keys)
        return lease.sealed

    # --- both sides
    def release(self, lease_id: int) -> None:
        """Drop the lease's references (idempotent: an unknown id is ignored)."""
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return
        for pinned in reversed(lease.blocks):  # later blocks are reused before the prefix
            self._pool(pinned.tier).release(pinned.block)

    def active(self) -> list[TransferLease]:
        return list(self._leases.values())

    def pinned_refs(self) -> tuple[dict[int, int], dict[int, int]]:
        """Extra references the leases hold: (device block -> refs, cpu block -> refs)."""
        device: dict[int, int] = {}
        cpu: dict[int, int] = {}
        for lease in self._leases.values():
            for pinned in lease.blocks:
                refs = device if pinned.tier == "device" else cpu
                refs[pinned.block] = refs.get(pinned.block, 0) + 1
        return device, cpu

    def _get(self, lease_id: int) -> TransferLease:
        lease = self._leases.get(lease_id)
        if lease is None:
            raise InvalidOperation(f"no transfer lease {lease_id}")
        return lease
