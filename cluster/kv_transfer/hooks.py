"""`KVTransferHooks`: what the engine calls of a replica's KV transfer service (the engine
imports this protocol, never the service, so the dependency runs one way)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from cluster.kv_transfer.metrics import TransferCounters
    from cluster.kv_transfer.payload import KVPayload


class PulledBlocks(Protocol):
    def release(self) -> None:
        """Drop the pin on the pulled blocks (idempotent)."""
        ...


class KVTransferHooks(Protocol):
    async def prepare(self, request: Any) -> PulledBlocks | None:
        """Pull the request's missing leading blocks, if worth it; never raises for a failed
        pull (the blocks are then computed). None: nothing pulled."""
        ...

    async def export_blocks(self, block_keys: Sequence[bytes]) -> KVPayload: ...

    def snapshot(self) -> TransferCounters: ...
