"""Invariant checks behind `KVCacheManager.check_integrity()`.

Verified, for the device tier and the CPU tier alike:
1. every block's reference count equals the number of table entries that point to it;
2. a block is in the free queue iff its count is 0 (nothing is both free and referenced), the
   queue's links are consistent both ways, and its length matches the pool's counters;
3. unsealed free blocks precede cached ones (they are reused first); the index and the per-block
   keys agree and each cached key digests to its block's hash; the CPU tier caches nothing
   unless it is a cache tier (`block_manager.tiers`), whose in-flight pins count as references;
4. every table has ceil(tokens / block_size) blocks, no block twice, counts in range, and its
   sealed hashes equal the recomputed hash chain (``verify_hashes``; its first
   ``unsalted_blocks`` blocks, which lie within its tokens, without extra keys); a device
   block is cached under exactly the hash its tables sealed it with (so every sealed device
   block is findable);
5. every slot a sequence may still write (positions ``[num_computed, num_tokens)``) lies in a
   block it holds alone and that is not sealed, so no two sequences can write the same slot.
Cost: O(blocks + table entries), plus one sha256 per sealed block when ``verify_hashes``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from block_manager.errors import IntegrityError
from block_manager.identity import chain_blocks, tokens_to_bytes
from block_manager.pool import BlockPool
from block_manager.table import BlockTable
from block_manager.types import SeqId


def _fail(message: str) -> None:
    raise IntegrityError(message)


def check_pool(
    pool: BlockPool,
    expected_refs: list[int],
    *,
    verify_hashes: bool = True,
    cpu_caches: bool = False,
) -> None:
    """Invariants 1-3 for one tier, given the references counted from the tables."""
    tier = pool.tier
    if pool.ref_counts != expected_refs:
        for block, (have, want) in enumerate(zip(pool.ref_counts, expected_refs, strict=True)):
            if have != want:
                _fail(f"{tier} block {block}: ref count {have} but tables hold {want} references")
    order = pool.free_queue()
    if len(order) > pool.num_blocks:
        _fail(f"{tier} free queue has a cycle or more entries than blocks")
    if len(set(order)) != len(order):
        _fail(f"{tier} free queue holds a block twice")
    if len(order) != pool.num_free:
        _fail(f"{tier} free queue has {len(order)} blocks but num_free is {pool.num_free}")
    sentinel = pool.sentinel
    previous = sentinel
    seen_cached = False
    cached_free = 0
    for block in order:
        if pool.links(block)[0] != previous:
            _fail(f"{tier} free queue: block {block}'s prev link is not {previous}")
        previous = block
        if pool.ref_counts[block] != 0:
            _fail(f"{tier} block {block} is free and referenced ({pool.ref_counts[block]})")
        if pool.hashes[block] is not None:
            seen_cached = True
            cached_free += 1
        elif seen_cached:
            _fail(f"{tier} free queue: unsealed block {block} sits behind a cached block")
    if pool.links(sentinel)[0] != previous:
        _fail(f"{tier} free queue: sentinel's prev link is not the last block {previous}")
    if cached_free != pool.num_free_cached:
        _fail(f"{tier}: {cached_free} cached free blocks but counter says {pool.num_free_cached}")
    queued = set(order)
    for block, refs in enumerate(pool.ref_counts):
        if refs < 0:
            _fail(f"{tier} block {block} has negative ref count {refs}")
        if refs == 0 and block not in queued:
            _fail(f"{tier} block {block} is unreferenced but not in the free queue")
        if refs > 0 and pool.links(block) != (-1, -1):
            _fail(f"{tier} block {block} is referenced but still linked into the free queue")
    for key, block in pool.cached.items():
        if not 0 <= block < pool.num_blocks or pool.keys[block] != key:
            _fail(f"{tier} hash index entry points to block {block} with a different key")
        if verify_hashes and hashlib.sha256(key).digest() != pool.hashes[block]:
            _fail(f"{tier} block {block}: its hash is not the digest of its cached key")
    if sum(k is not None for k in pool.keys) != len(pool.cached):
        _fail(f"{tier}: a block carries a key that the index does not map back to it")
    for block, (key, block_hash) in enumerate(zip(pool.keys, pool.hashes, strict=True)):
        if (key is None) != (block_hash is None):
            _fail(f"{tier} block {block}: hash and key must be set together")
    if tier == "cpu" and pool.cached and not cpu_caches:
        _fail("cpu tier must not cache blocks by hash")


def _check_chain(seq_id: SeqId, table: BlockTable, block_size: int) -> None:
    sealed = len(table.hashes)
    data = tokens_to_bytes(table.tokens[: sealed * block_size])
    recomputed = chain_blocks(
        table.hash_seed, data, block_size, table.hash_suffix, table.unsalted_blocks
    )[1]
    for index, (have, want) in enumerate(zip(table.hashes, recomputed, strict=True)):
        if have != want:
            _fail(f"sequence {seq_id}: block {index}'s hash does not match the recomputed chain")


def check_manager_integrity(
    *,
    device: BlockPool,
    cpu: BlockPool,
    tables: Mapping[SeqId, BlockTable],
    block_size: int,
    caching: bool,
    verify_hashes: bool,
    pinned: tuple[dict[int, int], dict[int, int]] | None = None,
    lease_pins: tuple[dict[int, int], dict[int, int]] = ({}, {}),
) -> None:
    """Invariants 1-5 over both tiers and every table; raises `IntegrityError`. `pinned`: the
    CPU cache tier's in-flight references (device, cpu), when the tier is on; `lease_pins`:
    the references of blocks moving between replicas (`block_manager.transfer_leases`)."""
    refs = {"device": [0] * device.num_blocks, "cpu": [0] * cpu.num_blocks}
    for tier, extra in zip(("device", "cpu"), pinned or ({}, {}), strict=True):
        for block, count in extra.items():
            refs[tier][block] += count
    for tier, extra in zip(("device", "cpu"), lease_pins, strict=True):
        for block, count in extra.items():
            refs[tier][block] += count
    exclusive: list[tuple[SeqId, BlockPool, int]] = []
    for seq_id, table in tables.items():
        num_tokens, blocks = len(table.tokens), table.block_ids
        if num_tokens == 0 or len(blocks) != -(-num_tokens // block_size):
            _fail(f"sequence {seq_id}: {len(blocks)} blocks for {num_tokens} tokens")
        if not 0 <= table.num_computed <= num_tokens:
            _fail(f"sequence {seq_id}: num_computed {table.num_computed} out of range")
        if len(table.hashes) * block_size > table.num_computed:
            _fail(f"sequence {seq_id}: a sealed block is not fully computed")
        if not 0 <= table.unsalted_blocks * block_size <= num_tokens:
            _fail(f"sequence {seq_id}: {table.unsalted_blocks} unsalted blocks out of range")
        if table.hashes and not caching:
            _fail(f"sequence {seq_id}: blocks sealed with prefix caching disabled")
        on_cpu = table.on_cpu
        if not 0 <= table.synced <= len(blocks) or (on_cpu is not None and table.synced):
            _fail(f"sequence {seq_id}: the workers' view ({table.synced} blocks) is out of range")
        if on_cpu is not None and len(on_cpu) != len(blocks):
            _fail(f"sequence {seq_id}: tier flags do not match the table length")
        seen: set[tuple[bool, int]] = set()
        first_writable = (
            table.num_computed // block_size if table.num_computed < num_tokens else len(blocks)
        )
        for index, block in enumerate(blocks):
            pool = cpu if on_cpu is not None and on_cpu[index] else device
            if not 0 <= block < pool.num_blocks:
                _fail(f"sequence {seq_id}: {pool.tier} block id {block} out of range")
            key = (pool is cpu, block)
            if key in seen:
                _fail(f"sequence {seq_id}: {pool.tier} block {block} appears twice in its table")
            seen.add(key)
            refs[pool.tier][block] += 1
            cached_hash = pool.hashes[block]
            sealed_hash = table.hashes[index] if index < len(table.hashes) else None
            if pool is device and cached_hash != sealed_hash:
                _fail(f"sequence {seq_id}: block {index} is cached under a different hash")
            if index >= first_writable:
                exclusive.append((seq_id, pool, block))
        if verify_hashes:
            _check_chain(seq_id, table, block_size)
    check_pool(device, refs["device"], verify_hashes=verify_hashes)
    check_pool(cpu, refs["cpu"], verify_hashes=verify_hashes, cpu_caches=pinned is not None)
    for seq_id, pool, block in exclusive:
        if pool.ref_counts[block] != 1:
            _fail(
                f"sequence {seq_id}: writable {pool.tier} block {block} is shared "
                f"({pool.ref_counts[block]} holders)"
            )
        if pool.hashes[block] is not None:
            _fail(f"sequence {seq_id}: writable {pool.tier} block {block} is sealed")
