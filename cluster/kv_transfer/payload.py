"""What crosses the wire when a replica pulls KV blocks: `KVPayload`, and why a pull failed.

Invariants a receiver relies on (and checks again, never trusting the holder's word alone):
- `blocks` is a leading run of the keys asked for, in chain order, each with the chain hash
  the holder sealed it under, and `shards[r]` carries rank r's bytes of exactly those blocks
  (row i is block i), with the digest of every row taken when it was read;
- a block's `generation` (when pinned) equals its `generation_after` (when the read ended)
  unless it was rewritten while in flight: such a block and every later one are unusable.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from workers.block_io import BlockShard


class PullFailure(enum.StrEnum):
    """Why a pull fell back to computing (the label of `pagedserve_kv_transfer_fallbacks`)."""

    NOT_HELD = "not_held"
    """The holder no longer had the blocks (evicted since the directory heard of them)."""
    STALE = "stale"
    """A block's generation changed while it was in flight (rewritten or discarded)."""
    CHECKSUM = "checksum"
    """A block's bytes did not match their digest (corrupted at the source or in flight)."""
    MISMATCH = "mismatch"
    """The payload is not what was asked (other hashes, another TP split or block size)."""
    HOLDER_FAILED = "holder_failed"
    """The holder died or raised."""
    TIMEOUT = "timeout"
    """The holder did not answer within the pull's timeout."""
    NO_FREE_BLOCKS = "no_free_blocks"
    """This replica had no free device blocks to land the pull in."""


class TransferError(Exception):
    """A transport could not fetch the blocks; `cause` says why."""

    def __init__(self, message: str, cause: PullFailure) -> None:
        super().__init__(message)
        self.cause = cause

    def __reduce__(self) -> tuple[object, ...]:
        return (TransferError, (str(self), self.cause))


@dataclass(frozen=True)
class ExportedBlock:
    """One block a holder sent: its chain hash, the tier it was read from, and its generation
    when pinned and when the read ended."""

    block_hash: bytes
    tier: str
    generation: int
    generation_after: int


@dataclass
class KVPayload:
    """A holder's answer to `export_blocks` (see the module doc)."""

    holder: str
    blocks: list[ExportedBlock] = field(default_factory=list)
    shards: list[BlockShard] = field(default_factory=list)
    read_seconds: float = 0.0
    """How long the holder's ranks took to read the blocks."""

    @property
    def num_bytes(self) -> int:
        return sum(shard.num_bytes for shard in self.shards)
