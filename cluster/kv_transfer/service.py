"""`KVTransferService`: one replica's both ends of KV pulls (exporter, puller, their counters and
cost model), what `AsyncEngine.attach_kv_transfer` takes."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from cluster.kv_transfer.cost_model import TransferCostModel
from cluster.kv_transfer.exporter import KVExporter
from cluster.kv_transfer.metrics import TransferCounters
from cluster.kv_transfer.payload import KVPayload
from cluster.kv_transfer.puller import HolderLocator, KVPuller, PulledPrefix, PullSettings
from cluster.kv_transfer.transport import KVTransport


class KVTransferService:
    def __init__(
        self,
        replica_id: str,
        core: Any,
        transport: KVTransport,
        locator: HolderLocator | None = None,
        settings: PullSettings | None = None,
        cost: TransferCostModel | None = None,
        *,
        pull: bool = True,
        on_pulled: Callable[[str, int, int], None] | None = None,
    ) -> None:
        """`pull` False: this replica only exports (serves its blocks to peers). `on_pulled`
        (holder, blocks, bytes) is told of every pull that brought blocks (the directory's
        tally)."""
        self.counters = TransferCounters()
        self.cost = cost if cost is not None else TransferCostModel()
        self.exporter = KVExporter(replica_id, core, self.counters)
        self.puller = (
            KVPuller(
                replica_id,
                core,
                transport,
                locator,
                settings or PullSettings(),
                self.counters,
                self.cost,
                on_pulled,
            )
            if pull
            else None
        )

    async def prepare(self, request: Any) -> PulledPrefix | None:
        return None if self.puller is None else await self.puller.prepare(request)

    async def export_blocks(self, block_keys: Sequence[bytes]) -> KVPayload:
        return await self.exporter.export_blocks(block_keys)

    def snapshot(self) -> TransferCounters:
        return self.counters.snapshot()
