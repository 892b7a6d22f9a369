"""Small value types shared by the manager and its callers."""

from __future__ import annotations

from dataclasses import dataclass

SeqId = int


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """A copy-on-write the workers must perform before the step's forward pass.

    Copy the first `num_tokens` slots of device block `src` into device block `dst`.
    """

    src: int
    dst: int
    num_tokens: int
