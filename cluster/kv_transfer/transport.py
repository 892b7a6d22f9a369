"""`KVTransport`: how a receiver gets a holder's blocks, behind one small interface.

Implementations: `InProcessTransport` (engines in one process: tests, offline tools) and
`cluster.serving.kv_transport.ServeKVTransport` (an actor call on the holder's engine replica,
its shards carried by Ray's object store). A GPU transport keeps the same call: the metadata
round trip stays an actor call and each rank's shard moves rank to rank (NCCL between the two
TP groups, staged through CPU memory where no direct path exists); only `KVPayload.shards`
changes from bytes to handles the receiving ranks complete.

Invariants: `fetch` returns a `KVPayload` for a leading run of the keys asked (possibly empty)
or raises `TransferError` with its cause; it never returns KV of another key; the holder pins
what it sends until its ranks have read it and releases the pins whatever happens.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from cluster.kv_transfer.payload import KVPayload, PullFailure, TransferError


class KVTransport(Protocol):
    async def fetch(
        self, holder: str, block_keys: Sequence[bytes], *, deployment: str | None = None
    ) -> KVPayload:
        """The holder's blocks for the leading run of `block_keys` (exact hash preimages, the
        receiver's own cache keys) that it holds; `deployment`: the holder's Serve deployment
        when it is not the receiver's (None: the receiver's). Raises TransferError."""
        ...


Exporter = Callable[[Sequence[bytes]], Awaitable[KVPayload]]
"""A holder's `export_blocks`."""


class InProcessTransport:
    """Calls the holder's exporter directly (engines sharing one process and event loop)."""

    def __init__(self) -> None:
        self.exporters: dict[str, Exporter] = {}

    def register(self, replica: str, exporter: Exporter) -> None:
        self.exporters[replica] = exporter

    async def fetch(
        self, holder: str, block_keys: Sequence[bytes], *, deployment: str | None = None
    ) -> KVPayload:
        exporter = self.exporters.get(holder)
        if exporter is None:
            raise TransferError(f"no replica {holder!r}", PullFailure.HOLDER_FAILED)
        try:
            return await exporter(list(block_keys))
        except TransferError:
            raise
        except Exception as error:
            raise TransferError(
                f"replica {holder!r} failed: {error!r}", PullFailure.HOLDER_FAILED
            ) from error
