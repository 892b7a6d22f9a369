"""`LayoutUsage`: one KV layout's memory accounting at one instant, in token slots, and
`LayoutAccounting`, the managers that report it (a benchmark's view, not the engine's)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class LayoutUsage:
    """Memory accounting of one layout at one instant, in token slots (x bytes per slot = bytes).

    reserved: slots set aside for live sequences (contiguous: their max-length runs; virtual:
    their virtual ranges, which cost address space, not memory; paged: their blocks).
    backed: slots physically committed to live sequences (contiguous: = reserved, the memory is
    dedicated; virtual: committed pages; paged: = their blocks).
    live: slots holding a token. internal_fragmentation: backed-but-empty slots inside the last
    block or page of each sequence; reservation_waste: reserved slots beyond that (contiguous: the
    unused tail of each max-length reservation; 0 for paged and virtual).

    Invariant: live + internal_fragmentation + reservation_waste == reserved for contiguous and
    paged; backed <= pool for every layout.
    """

    reserved_slots: int
    backed_slots: int
    live_slots: int
    internal_fragmentation_slots: int
    reservation_waste_slots: int
    pool_slots: int


@runtime_checkable
class LayoutAccounting(Protocol):
    """A KV manager that reports its memory accounting (every layout's manager does); it scans
    every table, so only the layouts benchmark asks, never the engine's step."""

    def usage(self) -> LayoutUsage: ...
