"""Typed failures of the block manager.

Every mutating operation either succeeds whole or raises one of these with nothing changed, so
the scheduler can tell "wait / preempt / swap" (`NoFreeBlocks`) from "reject" (`NeverFits`) from
a bug in the caller (`InvalidOperation`).
"""

from __future__ import annotations

from typing import Literal

Tier = Literal["device", "cpu"]


class BlockManagerError(Exception):
    """Base class of every error the block manager raises on purpose."""


class InvalidOperation(BlockManagerError, ValueError):
    """Misuse or bad input: unknown sequence, double free, bad sizes, append while swapped..."""


class AllocationFailure(BlockManagerError):
    """Not enough blocks; `needed` and `available` are in blocks, `reason` says why in words."""

    def __init__(self, reason: str, *, needed: int, available: int) -> None:
        super().__init__(f"{reason} (needed {needed} blocks, available {available})")
        self.reason = reason
        self.needed = needed
        self.available = available


class NoFreeBlocks(AllocationFailure):
    """Not enough free blocks in `tier` right now: the scheduler may wait, preempt or swap."""

    def __init__(self, reason: str, *, needed: int, available: int, tier: Tier) -> None:
        super().__init__(f"{tier} tier: {reason}", needed=needed, available=available)
        self.tier: Tier = tier


class NeverFits(AllocationFailure):
    """The request needs more blocks than the whole device pool has: it must be rejected."""


class IntegrityError(AssertionError):
    """`check_integrity()` found a broken invariant; the message names it."""
