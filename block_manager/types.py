"""Small value types shared by the manager and its callers."""

from __future__ import annotations

from dataclasses import dataclass

SeqId = int


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """A copy-on-write the workers must perform before the step's forward pass.

    Copy the first `num_tokens` slots of device block `src` into device block `dst`, and
    likewise for each (src, dst) pair in `also` (the same write's tails in the other KV groups
    of the hybrid manager, `block_manager.hybrid`; empty otherwise).
    """

    src: int
    dst: int
    num_tokens: int
    also: tuple[tuple[int, int], ...] = ()

    def pairs(self) -> list[tuple[int, int]]:
        """Every (src, dst) block pair of this copy-on-write."""
        return [(self.src, self.dst), *self.also]
