"""`KVSourceHint`: where a request's leading KV blocks can be pulled from, named by the caller.

A request that carries one is pulled from that holder unconditionally (no directory query, no
cost model: a disaggregated prefill replica just computed them), and computed on any failure.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVSourceHint:
    """`holder`: the engine replica id holding the blocks; `block_hashes`: their chain hashes, a
    leading run of the request's own chain (`RequestKeys.block_hashes`). The receiver pulls the
    leading blocks of its own chain that match these hashes and that it lacks; a hash that does
    not match its chain (another identity, tenant or adapter) ends the run there."""

    holder: str
    block_hashes: tuple[bytes, ...]
    deployment: str | None = None
    """The holder's Serve deployment when it is not the receiver's own (a prefill deployment
    beside a decode one); None: the receiver's."""
