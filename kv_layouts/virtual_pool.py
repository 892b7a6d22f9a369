"""The `virtual` KV layout's pool on CPU: an anonymous mapping reserved without committing memory.

The pool tensor `[layers, 2, blocks, block_size, kv_heads, head_dim]` lies over an anonymous
`mmap`: the kernel commits a page on first touch (a minor page fault, counted by `getrusage`) and
`madvise(MADV_DONTNEED)` hands a range back (the next touch reads zeros again). Huge pages are
turned off for the mapping so a fault commits one base page, not 2 MiB.

Geometry (`virtual_geometry`): slot i owns block ids `[i * slot_blocks, (i + 1) * slot_blocks)`;
`commit_blocks` is the fewest blocks whose bytes in one (layer, K/V) plane are a whole number of
pages, and `slot_blocks` is a multiple of it, so every slot and every commit unit starts on a page
boundary in every plane and a decommit never touches a neighbour's page.

CUDA's equivalent (reserve a virtual range, create and map 2 MiB physical handles on demand) is
not implemented: this machine has no GPU to test it on, so `allocate_virtual_pool` refuses CUDA.
"""

from __future__ import annotations

import ctypes
import math
import mmap
from dataclasses import dataclass

import numpy as np
import torch

PAGE_BYTES = mmap.PAGESIZE


@dataclass(frozen=True)
class VirtualGeometry:
    """Slot and commit sizes of a virtual pool, in blocks."""

    num_slots: int
    slot_blocks: int
    commit_blocks: int

    @property
    def num_blocks(self) -> int:
        return self.num_slots * self.slot_blocks


def virtual_geometry(
    num_slots: int, max_model_len: int, block_size: int, plane_block_bytes: int
) -> VirtualGeometry:
    """`plane_block_bytes`: bytes of one block in one (layer, K/V) plane of the pool."""
    if min(num_slots, max_model_len, block_size, plane_block_bytes) <= 0:
        raise ValueError(
            f"virtual pool sizes must be positive: num_slots={num_slots}, "
            f"max_model_len={max_model_len}, block_size={block_size}, "
            f"plane_block_bytes={plane_block_bytes}"
        )
    commit = PAGE_BYTES // math.gcd(PAGE_BYTES, plane_block_bytes)
    blocks = -(-max_model_len // block_size)
    return VirtualGeometry(num_slots, -(-blocks // commit) * commit, commit)


class _Mincore:
    """`mincore(2)`: which pages of a range are resident."""

    def __init__(self) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]

    def resident_pages(self, address: int, length: int) -> int:
        pages = -(-length // PAGE_BYTES)
        vector = np.zeros(pages, dtype=np.uint8)
        if self._libc.mincore(address, length, vector.ctypes.data) != 0:
            raise OSError(ctypes.get_errno(), "mincore failed on the virtual KV pool")
        return int(np.count_nonzero(vector & 1))


class VirtualKVPool:
    """A KV pool tensor over an uncommitted anonymous mapping (CPU only)."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
    ) -> None:
        self.shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        element = torch.empty((), dtype=dtype).element_size()
        self.plane_block_bytes = block_size * num_kv_heads * head_dim * element
        self.plane_bytes = num_blocks * self.plane_block_bytes
        if self.plane_bytes % PAGE_BYTES:
            raise ValueError(
                f"a plane of the virtual pool ({self.plane_bytes} bytes) must be a whole number "
                f"of {PAGE_BYTES}-byte pages (use virtual_geometry to size it)"
            )
        self.nbytes = 2 * num_layers * self.plane_bytes
        self._map = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_NOHUGEPAGE"):
            self._map.madvise(mmap.MADV_NOHUGEPAGE)
        self._address = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        flat = torch.frombuffer(self._map, dtype=dtype, count=self.nbytes // element)
        self.tensor = flat.view(self.shape)
        self._mincore = _Mincore()
        self.decommit_calls = 0

    def decommit(self, ranges: list[tuple[int, int]]) -> None:
        """Return the pages of block ranges `[first, end)` (every layer, K and V) to the OS."""
        num_blocks = self.shape[2]
        for first, end in ranges:
            if not 0 <= first <= end <= num_blocks:
                raise ValueError(f"decommit range [{first}, {end}) is outside [0, {num_blocks})")
            start = first * self.plane_block_bytes
            length = (end - first) * self.plane_block_bytes
            if start % PAGE_BYTES:
                raise ValueError(
                    f"decommit range [{first}, {end}) does not start on a page boundary"
                )
            length = -(-length // PAGE_BYTES) * PAGE_BYTES
            if length == 0:
                continue
            for plane in range(2 * self.shape[0]):
                self._map.madvise(mmap.MADV_DONTNEED, plane * self.plane_bytes + start, length)
                self.decommit_calls += 1

    def resident_bytes(self) -> int:
        """Bytes of the pool physically backed now (resident pages, from `mincore`).

        A page only ever read is mapped to the kernel's shared zero page and counts here too;
        the engine reads only slots it has written, so for it this is the committed memory.
        """
        return self._mincore.resident_pages(self._address, self.nbytes) * PAGE_BYTES
