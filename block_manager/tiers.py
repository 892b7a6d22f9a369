"""The CPU pool as a second cache tier: demotion of evicted prefix blocks, promotion on a hit.

With the tier on, the CPU pool caches sealed blocks by the same exact hash preimage as the device
pool (so a CPU hit follows exactly the device's identity rules: same key, same chain):

- **Demotion**: when the device pool is about to reuse a cached block (`BlockPool.on_evict`), the
  block is first copied to a CPU block (an unsealed free one, else the least recently used cached
  one) and sealed there under the same key; nothing is copied if the CPU tier already holds the key
  or has no free block. The (device, cpu) pair is executed by the workers before anything else in
  the step, so before the device block is overwritten.
- **Promotion**: a prefix lookup walks the chain on the device first and then on the CPU tier,
  block by block, and stops at the first block neither holds. A CPU hit gets a fresh device block,
  sealed under the same key, and a (cpu, device) copy pair; the CPU copy stays cached.
- **In flight**: the CPU blocks a step reads or writes (demotion targets, promotion and swap-in
  sources) and the device blocks promotions write are pinned (an extra reference) from planning
  until `complete()`, which the scheduler calls once the workers ran the step; so no block is
  reused while a copy to or from it is pending, whatever order the step's other pops come in.
  Each step's pins are its own (`take(step_id)`), so with a step planned ahead of the one
  running, completing the running one leaves the later one's pins in place.
- **Generations**: `copied_at[c]` is the CPU pool's generation of `c` when the copy into it was
  planned; a hit on a block whose generation moved since is refused (a miss, the entry dropped,
  counted) and never served.
Events: a demotion is a CPU store (after the device's own removal), an LRU eviction or a refusal a
CPU removal, a promotion a device store, so an index replaying events follows every tier move.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from block_manager.identity import block_suffix
from block_manager.pool import BlockPool


@dataclass
class TierCounters:
    """Cumulative counts of the CPU cache tier (all zero when it is off)."""

    device_hit_tokens: int = 0
    cpu_hit_tokens: int = 0
    demoted_blocks: int = 0
    promoted_blocks: int = 0
    refused_swap_ins: int = 0
    """CPU hits refused because their block's generation changed since it was copied."""
    discarded_blocks: int = 0
    """Blocks made unfindable after the workers found their bytes corrupt (`discard`)."""


@dataclass
class TierTransfers:
    """One step's tier copies: `demote` (device, cpu) and `promote` (cpu, device) pairs."""

    demote: list[tuple[int, int]] = field(default_factory=list)
    promote: list[tuple[int, int]] = field(default_factory=list)


@dataclass(eq=False)
class StepPins:
    """What one step's copies pin until it completes: CPU blocks with their extra references,
    device blocks, and the device blocks its copies still have to fill."""

    step_id: int
    cpu: list[tuple[int, int]]
    device: list[int]
    incoming: set[int]


@dataclass
class CpuHits:
    """What a two-tier lookup found past the device hits: the CPU blocks to promote in chain
    order (their logical indices follow the device hits) and a refused (stale) block, if any."""

    blocks: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)
    stale: int | None = None


class CpuTier:
    """Demotion, promotion and pins over a device pool and a CPU pool (see the module docs)."""

    __slots__ = (
        "copied_at",
        "counters",
        "cpu",
        "device",
        "in_flight",
        "incoming",
        "pinned_cpu",
        "pinned_device",
        "promote",
        "transfers",
    )

    def __init__(self, device: BlockPool, cpu: BlockPool) -> None:
        self.device = device
        self.cpu = cpu
        self.copied_at: list[int] = [-1] * cpu.num_blocks
        self.counters = TierCounters()
        self.transfers = TierTransfers()
        self.pinned_cpu: list[tuple[int, int]] = []  # (cpu block, references) until complete()
        self.pinned_device: list[int] = []
        self.incoming: set[int] = set()  # device blocks a pending copy still has to fill
        self.in_flight: list[StepPins] = []
        """The pins of steps taken and not completed yet, oldest first."""
        self.promote = True
        """Whether CPU hits are promoted (the cost model's call); False: they are misses."""
        device.on_evict = self._demote

    # --- demotion
    def _demote(self, block: int, key: bytes, digest: bytes) -> None:
        """`device` is about to reuse cached `block`: keep its KV findable in the CPU tier."""
        if block in self.incoming or any(block in pins.incoming for pins in self.in_flight):
            return  # its KV has not landed yet; whoever copies it in holds a CPU copy already
        cpu = self.cpu
        holder = cpu.cached.get(key)
        if holder is not None:
            cpu.touch(holder)
            return
        if cpu.num_free == 0:
            return  # every CPU block is held by swapped sequences or in flight: plain eviction
        target = cpu.pop_free()  # unsealed free blocks first, then the least recently used
        cpu.seal(target, key, digest)
        self.copied_at[target] = cpu.generations[target]
        self.transfers.demote.append((block, target))
        self.pinned_cpu.append((target, 1))  # pop_free's reference, dropped by complete()
        self.counters.demoted_blocks += 1

    # --- promotion
    def match(
        self,
        parent: bytes,
        tokens_data: bytes,
        first: int,
        max_blocks: int,
        block_size: int,
        suffix: bytes,
        unsalted_blocks: int,
    ) -> CpuHits:
        """Continue a chain whose blocks ``< first`` hit the device (`parent` the last hash):
        each next block is looked up on the device, then in the CPU tier; the walk stops at the
        first block neither holds (or a CPU hit refused as stale). Reads only."""
        hits = CpuHits()
        if not self.promote:
            return hits
        prefix, width = block_size.to_bytes(4, "little"), block_size * 4
        device_cached, cpu = self.device.cached, self.cpu
        for index in range(first, max_blocks):
            start = index * width
            extra = block_suffix(index, suffix, unsalted_blocks)
            key = parent + prefix + tokens_data[start : start + width] + extra
            if key in device_cached:
                break  # a device block after a CPU one: keep the plan simple, stop here
            block = cpu.cached.get(key)
            if block is None:
                break
            if cpu.generations[block] != self.copied_at[block]:
                hits.stale = block
                break
            digest = cpu.hashes[block]
            assert digest is not None
            hits.blocks.append(block)
            hits.hashes.append(digest)
            parent = digest
        return hits

    def pin_hits(self, hits: CpuHits) -> None:
        """Take the CPU hits out of the free queue before any device block is popped (a
        demotion must not evict them); `promote_into` then plans their copies."""
        cpu = self.cpu
        for block in hits.blocks:
            cpu.acquire(block)
            self.pinned_cpu.append((block, 1))
        if hits.stale is not None:
            cpu.unseal(hits.stale)
            self.counters.refused_swap_ins += 1

    def promote_into(self, hits: CpuHits, targets: list[int]) -> None:
        """Seal fresh device `targets` under the hits' keys and plan the copies into them."""
        device, cpu = self.device, self.cpu
        for source, target in zip(hits.blocks, targets, strict=True):
            key, digest = cpu.keys[source], cpu.hashes[source]
            assert key is not None and digest is not None
            device.seal(target, key, digest)
            device.acquire(target)
            self.pinned_device.append(target)
            self.incoming.add(target)
            self.transfers.promote.append((source, target))
        self.counters.promoted_blocks += len(hits.blocks)

    # --- swaps of preempted sequences
    def defer_release(self, cpu_block: int, refs: int) -> None:
        """A swap-in reads `cpu_block` this step: drop the group's references at `complete`."""
        self.pinned_cpu.append((cpu_block, refs))

    # --- step boundary
    def take(self, step_id: int = 0) -> TierTransfers:
        """The copies planned since the last call (the workers run demotions first), for step
        `step_id`, which keeps their pins until it completes."""
        transfers, self.transfers = self.transfers, TierTransfers()
        if self.pinned_cpu or self.pinned_device or self.incoming:
            self.in_flight.append(
                StepPins(step_id, self.pinned_cpu, self.pinned_device, self.incoming)
            )
            self.pinned_cpu, self.pinned_device, self.incoming = [], [], set()
        return transfers

    def complete(self, step_id: int | None = None) -> None:
        """The workers ran step `step_id` and every step before it (None: every step taken,
        and what was pinned since): their copies landed, their pins go."""
        cpu, device = self.cpu, self.device
        done = [p for p in self.in_flight if step_id is None or p.step_id <= step_id]
        if step_id is None:
            done.append(StepPins(0, self.pinned_cpu, self.pinned_device, self.incoming))
            self.pinned_cpu, self.pinned_device, self.incoming = [], [], set()
        self.in_flight = [p for p in self.in_flight if p not in done]
        for pins in done:
            for block, refs in pins.cpu:
                cpu.release(block, refs)
            for block in pins.device:
                device.release(block)

    def pinned_refs(self) -> tuple[dict[int, int], dict[int, int]]:
        """Extra references the pins hold: (device block -> refs, cpu block -> refs)."""
        device: dict[int, int] = {}
        cpu: dict[int, int] = {}
        everything = [*self.in_flight, StepPins(0, self.pinned_cpu, self.pinned_device, set())]
        for pins in everything:
            for block in pins.device:
                device[block] = device.get(block, 0) + 1
            for block, refs in pins.cpu:
                cpu[block] = cpu.get(block, 0) + refs
        return device, cpu

    def discard(self, device_blocks: list[int], cpu_blocks: list[int]) -> None:
        """Make blocks whose bytes failed a checksum unfindable in both tiers (their KV must
        never be served again); the caller fails every sequence that holds them."""
        for pool, blocks in ((self.device, device_blocks), (self.cpu, cpu_blocks)):
            for block in blocks:
                if pool.keys[block] is not None:
                    pool.unseal(block)
                    self.counters.discarded_blocks += 1
