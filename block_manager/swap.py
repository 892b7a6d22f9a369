"""Swap planning between the device pool and the CPU pool for a group of sequences.

A group (the branches of one request) moves together. A block moves only when every reference to it
comes from the group, so blocks shared only within the group move once and blocks that any other
sequence still holds stay on the device (the swapped tables keep referencing them there). Planning
checks capacity first; `commit` then mutates, so a swap fails whole or succeeds whole.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from block_manager.errors import NoFreeBlocks
from block_manager.pool import BlockPool
from block_manager.table import BlockTable


@dataclass
class SwapCounters:
    """Blocks copied device -> CPU and CPU -> device since the manager was built."""

    out_blocks: int = 0
    in_blocks: int = 0


def _group_references(tables: list[BlockTable], *, cpu_side: bool) -> dict[int, int]:
    """References the group holds to each block of one tier, in first-appearance order."""
    refs: dict[int, int] = {}
    for table in tables:
        on_cpu = table.on_cpu
        for index, block in enumerate(table.block_ids):
            is_cpu = on_cpu is not None and on_cpu[index]
            if is_cpu == cpu_side:
                refs[block] = refs.get(block, 0) + 1
    return refs


@dataclass
class SwapOutPlan:
    device: BlockPool
    cpu: BlockPool
    tables: list[BlockTable]
    group_refs: dict[int, int]
    moving: list[int]

    @property
    def fits(self) -> bool:
        return len(self.moving) <= self.cpu.num_free

    def commit(self, counters: SwapCounters) -> list[tuple[int, int]]:
        if not self.fits:
            raise NoFreeBlocks(
                "cannot swap out the group",
                needed=len(self.moving),
                available=self.cpu.num_free,
                tier="cpu",
            )
        mapping: dict[int, int] = {}
        for block in self.moving:
            cpu_block = self.cpu.pop_free()
            self.cpu.ref_counts[cpu_block] = self.group_refs[block]
            mapping[block] = cpu_block
        for table in self.tables:
            table.on_cpu = [block in mapping for block in table.block_ids]
            table.block_ids = [mapping.get(block, block) for block in table.block_ids]
        for block in reversed(self.moving):
            self.device.release(block, self.group_refs[block])
        counters.out_blocks += len(mapping)
        return list(mapping.items())


def plan_swap_out(device: BlockPool, cpu: BlockPool, tables: list[BlockTable]) -> SwapOutPlan:
    """Blocks referenced only by the group move; the rest stay on the device."""
    group_refs = _group_references(tables, cpu_side=False)
    moving = [block for block, refs in group_refs.items() if device.ref_counts[block] == refs]
    return SwapOutPlan(device, cpu, tables, group_refs, moving)


@dataclass
class SwapInPlan:
    device: BlockPool
    cpu: BlockPool
    tables: list[BlockTable]
    group_refs: dict[int, int]
    hashes: dict[int, tuple[bytes, bytes] | None]  # cpu block -> (preimage, hash) if sealed
    cache_hits: dict[int, int]
    needed: int
    watermark: int

    @property
    def fits(self) -> bool:
        return self.needed <= self.device.num_free - self.watermark

    def commit(
        self, counters: SwapCounters, defer_release: Callable[[int, int], None] | None = None
    ) -> list[tuple[int, int]]:
        """`defer_release(cpu_block, refs)`: hand the group's CPU references over instead of
        dropping them now (the CPU cache tier pins a swap-in's sources until the copy ran)."""
        device = self.device
        if not self.fits:
            raise NoFreeBlocks(
                f"cannot swap in the group (watermark {self.watermark} kept free)",
                needed=self.needed,
                available=max(device.num_free - self.watermark, 0),
                tier="device",
            )
        mapping: dict[int, int] = {}
        # Take the cache hits first so that popping fresh blocks cannot evict them.
        for cpu_block, device_block in self.cache_hits.items():
            device.acquire(device_block, self.group_refs[cpu_block])
            mapping[cpu_block] = device_block
        pairs: list[tuple[int, int]] = []
        for cpu_block, refs in self.group_refs.items():
            if cpu_block in mapping:
                continue
            sealed = self.hashes[cpu_block]
            twin = device.cached.get(sealed[0]) if sealed is not None else None
            if twin is not None:  # copied in this swap-in from another CPU block: share it
                device.acquire(twin, refs)
                mapping[cpu_block] = twin
                continue
            device_block = device.pop_free()
            device.ref_counts[device_block] = refs
            if sealed is not None:
                device.seal(device_block, *sealed)
            mapping[cpu_block] = device_block
            pairs.append((cpu_block, device_block))
        for table in self.tables:
            on_cpu = table.on_cpu
            assert on_cpu is not None
            table.block_ids = [
                mapping[block] if is_cpu else block
                for block, is_cpu in zip(table.block_ids, on_cpu, strict=True)
            ]
            table.on_cpu = None
        for cpu_block in reversed(self.group_refs):
            if defer_release is None:
                self.cpu.release(cpu_block, self.group_refs[cpu_block])
            else:
                defer_release(cpu_block, self.group_refs[cpu_block])
        counters.in_blocks += len(pairs)
        return pairs


def plan_swap_in(
    device: BlockPool, cpu: BlockPool, tables: list[BlockTable], watermark: int, block_size: int
) -> SwapInPlan:
    """Each CPU block gets a device block; a sealed one whose hash is still cached reuses it."""
    group_refs = _group_references(tables, cpu_side=True)
    hashes: dict[int, tuple[bytes, bytes] | None] = {}
    for table in tables:
        on_cpu = table.on_cpu
        assert on_cpu is not None
        for index, block in enumerate(table.block_ids):
            if on_cpu[index] and block not in hashes:
                key = table.sealed_key(index, block_size)
                hashes[block] = None if key is None else (key, table.hashes[index])
    cache_hits: dict[int, int] = {}
    claimed: set[int] = set()
    copied_hashes: set[bytes] = set()
    needed = 0
    for cpu_block, sealed in hashes.items():
        device_block = device.cached.get(sealed[0]) if sealed is not None else None
        if device_block is None:
            if sealed is None or sealed[0] not in copied_hashes:
                needed += 1  # a second CPU copy of the same content reuses the first's block
            if sealed is not None:
                copied_hashes.add(sealed[0])
            continue
        cache_hits[cpu_block] = device_block
        if device.ref_counts[device_block] == 0 and device_block not in claimed:
            needed += 1
            claimed.add(device_block)
    return SwapInPlan(device, cpu, tables, group_refs, hashes, cache_hits, needed, watermark)
