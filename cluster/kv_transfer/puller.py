"""The receiver's side of a pull: before a request is queued, `KVPuller.prepare` brings the
leading blocks of its prompt that this replica lacks from a replica that holds them.

1. The request's own chain (its exact cache keys: identity seed, adapter, tenant salt, shared
   prefix) is computed here; blocks found locally (device or CPU tier) are not pulled.
2. The holder: the request's `KVSourceHint` when it carries one (pulled unconditionally), else
   the replica the KV directory says holds the most leading blocks beyond the local ones, if
   the cost model predicts the copy faster than computing those tokens.
3. Device blocks are reserved (`TransferLeases.reserve_import`), the holder's blocks fetched
   (`KVTransport.fetch`, bounded by `timeout_s`), checked (the hashes asked for, generations
   unchanged in flight, one shard per rank) and written by the ranks, each verifying its own
   shard's checksums; the verified leading run is sealed under this replica's own keys.
4. Whatever fails (no free block, not held any more, stale, corrupt, holder dead, timeout) the
   blocks not pulled are computed as if no pull was tried: never wrong KV, never a failed
   request. The lease (the pulled blocks' pin) lasts until the request holds them itself
   (`PulledPrefix.release`, called by the engine once the request produced its first output).

The pull runs in the request's own coroutine, beside the step loop: steps go on meanwhile and
the ranks take the reads and writes between steps.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from block_manager import NoFreeBlocks
from block_manager.prompt_blocks import prompt_block_keys
from cluster.kv_transfer.cost_model import TransferCostModel
from cluster.kv_transfer.metrics import TransferCounters
from cluster.kv_transfer.payload import KVPayload, PullFailure, TransferError
from cluster.kv_transfer.transport import KVTransport
from workers.block_io import BlockShard

log = logging.getLogger(__name__)


class HolderLocator(Protocol):
    async def holdings(self, chain: list[bytes]) -> dict[str, int]:
        """Leading blocks of `chain` each replica holds ({} when unknown); never raises."""
        ...


@dataclass(frozen=True)
class PullSettings:
    timeout_s: float = 10.0
    """A fetch that takes longer is abandoned (its blocks are computed)."""
    min_blocks: int = 1
    """Fewer missing blocks than this are computed without asking anyone."""
    use_cost_model: bool = True
    """False: pull whenever another replica holds more leading blocks (measurements, tests)."""

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or self.min_blocks < 1:
            raise ValueError("timeout_s must be > 0 and min_blocks >= 1")


@dataclass
class PulledPrefix:
    """Blocks a pull sealed here, pinned until `release` (idempotent)."""

    holder: str
    num_blocks: int
    lease_id: int
    leases: Any

    def release(self) -> None:
        if self.lease_id:
            self.leases.release(self.lease_id)
            self.lease_id = 0


class KVPuller:
    """`core`: this replica's `EngineCore` (paged layout, prefix caching on)."""

    def __init__(
        self,
        replica_id: str,
        core: Any,
        transport: KVTransport,
        locator: HolderLocator | None,
        settings: PullSettings,
        counters: TransferCounters,
        cost: TransferCostModel,
        on_pulled: Callable[[str, int, int], None] | None = None,
    ) -> None:
        self.replica_id = replica_id
        self.on_pulled = on_pulled
        self.core = core
        self.transport = transport
        self.locator = locator
        self.settings = settings
        self.counters = counters
        self.cost = cost

    async def prepare(self, request: Any) -> PulledPrefix | None:
        """Pull what is worth pulling for `request` (see the module doc); None: nothing pulled."""
        core = self.core
        bm = core.block_manager
        if not core.shares_prefixes:
            return None
        try:
            key = core.cache_key_for(request)
            ids = request.token_ids
            keys, hashes = prompt_block_keys(ids, key, bm.block_size)
            local = bm.cached_prefix_tokens(ids, key) // bm.block_size if keys else 0
        except Exception:  # a request the engine will reject: let add_request say why
            return None
        if local >= len(keys):
            return None
        choice = await self._choose_holder(request, hashes, local)
        if choice is None:
            return None
        holder, want = choice
        hint = getattr(request, "kv_source", None)
        deployment = hint.deployment if hint is not None else None
        return await self._pull(holder, keys[local:want], hashes[local:want], deployment)

    async def _choose_holder(
        self, request: Any, hashes: list[bytes], local: int
    ) -> tuple[str, int] | None:
        hint = getattr(request, "kv_source", None)
        if hint is not None:
            matched = 0
            for mine, theirs in zip(hashes, hint.block_hashes, strict=False):
                if mine != theirs:
                    break
                matched += 1
            if hint.holder == self.replica_id or matched - local < 1:
                return None
            return hint.holder, matched
        if self.locator is None:
            return None
        held = await self.locator.holdings(hashes)
        others = {r: n for r, n in held.items() if r != self.replica_id and n > local}
        if not others:
            return None
        holder = max(others, key=lambda r: others[r])
        want = min(others[holder], len(hashes))
        count = want - local
        if count < self.settings.min_blocks:
            return None
        if self.settings.use_cost_model:
            block_size = self.core.block_manager.block_size
            num_bytes = count * self.core.model_info.kv_bytes_per_block
            per_token = self.core.scheduler.cost_model.seconds_per_token
            if not self.cost.prefer_copy(holder, num_bytes, count * block_size, per_token):
                self.counters.declined += 1
                return None
        return holder, want

    async def _pull(
        self, holder: str, keys: list[bytes], hashes: list[bytes], deployment: str | None
    ) -> PulledPrefix | None:
        leases = self.core.block_manager.transfer_leases
        try:
            lease = leases.reserve_import(len(keys))
        except NoFreeBlocks:
            self.counters.fallback(PullFailure.NO_FREE_BLOCKS)
            return None
        began = time.perf_counter()
        written, cause, num_bytes = 0, None, 0
        try:
            try:
                payload = await asyncio.wait_for(
                    self.transport.fetch(holder, keys, deployment=deployment),
                    self.settings.timeout_s,
                )
                usable, cause = self._usable(payload, hashes)
                if usable:
                    written = await self.core.workers.write_blocks_async(
                        [pinned.block for pinned in lease.blocks[:usable]],
                        [_leading(shard, usable) for shard in payload.shards],
                    )
                    if written < usable:
                        cause = PullFailure.CHECKSUM
                    num_bytes = payload.num_bytes * written // max(len(payload.blocks), 1)
            except TimeoutError:
                cause = PullFailure.TIMEOUT
            except TransferError as error:
                cause = error.cause
            except Exception as error:
                log.warning("KV pull from %s failed: %r", holder, error)
                cause = PullFailure.HOLDER_FAILED
            if written:
                leases.seal_import(lease.lease_id, keys[:written])
        except BaseException:  # cancelled: the request went away while its blocks travelled
            leases.release(lease.lease_id)
            raise
        if cause is not None:
            self.counters.fallback(cause)
        if not written:
            leases.release(lease.lease_id)
            return None
        elapsed = time.perf_counter() - began
        self.cost.observe(holder, num_bytes, elapsed, fixed_seconds=0.0)
        counters = self.counters
        counters.pulls += 1
        counters.pulled_blocks += written
        counters.pulled_bytes += num_bytes
        counters.pull_seconds.observe(elapsed)
        counters.bandwidth_bytes_per_s[holder] = self.cost.bandwidth[holder]
        if self.on_pulled is not None:
            self.on_pulled(holder, written, num_bytes)
        return PulledPrefix(holder, written, lease.lease_id, leases)

    def _usable(
        self, payload: KVPayload, hashes: Sequence[bytes]
    ) -> tuple[int, PullFailure | None]:
        """How many leading blocks of `payload` may be written, and why not more."""
        ranks = self.core.workers.config.tensor_parallel_size
        count = len(payload.blocks)
        if count == 0:
            return 0, PullFailure.NOT_HELD
        if len(payload.shards) != ranks or any(len(s.rows) < count for s in payload.shards):
            return 0, PullFailure.MISMATCH
        for index, block in enumerate(payload.blocks[: len(hashes)]):
            if block.block_hash != hashes[index]:
                return index, PullFailure.MISMATCH
            if block.generation != block.generation_after:
                return index, PullFailure.STALE
        if count > len(hashes):
            return len(hashes), PullFailure.MISMATCH
        return count, (PullFailure.NOT_HELD if count < len(hashes) else None)


def _leading(shard: BlockShard, count: int) -> BlockShard:
    if count == len(shard.rows):
        return shard
    return BlockShard(
        shard.rows[:count], shard.checksums[:count], [i for i in shard.corrupt if i < count]
    )
