"""The `virtual` KV layout's pool on CPU: an anonymous mapping reserved without committing memory.

`VirtualPool` is the layout's `KVPool` on a rank: it reserves every slot of the geometry the
engine's manager uses (`kv_layouts.virtual.virtual_geometry`, from the same sizes) and, when a
plan releases a sequence, hands its whole slot back to the OS before the forward pass: the slot
is the run its cached block table starts in, so the plan needs to name no memory.

The pool tensor `[layers, 2, blocks, block_size, kv_heads, head_dim]` lies over an anonymous
`mmap`: the kernel commits a page on first touch (a minor page fault, counted by `getrusage`) and
`madvise(MADV_DONTNEED)` hands a range back (the next touch reads zeros again). Huge pages are
turned off for the mapping so a fault commits one base page, not 2 MiB.

CUDA's equivalent (reserve a virtual range, create and map 2 MiB physical handles on demand) is
not implemented: this machine has no GPU to test it on, so `VirtualPool.allocate` refuses CUDA.
"""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Sequence

import numpy as np
import torch

from kv_layouts.layout import PoolAllocator
from kv_layouts.virtual import PAGE_BYTES, VirtualGeometry, virtual_geometry
from workers.config import WorkerConfig
from workers.kv_memory import KVShape


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


class VirtualPool:
    """One virtual reservation of `max_num_seqs` slots of `max_model_len` tokens each, backed on
    first touch; a released sequence's slot goes back to the OS (CPU only: an anonymous mmap)."""

    def __init__(self, config: WorkerConfig, kv_shape: KVShape, max_model_len: int) -> None:
        self.config = config
        self.kv_shape = kv_shape
        self.max_model_len = max_model_len
        self.pool: VirtualKVPool | None = None
        self.geometry: VirtualGeometry | None = None
        self._returned = 0

    def allocate(
        self, num_device_blocks: int, device: torch.device, allocate_pool: PoolAllocator
    ) -> torch.Tensor:
        if device.type != "cpu":
            raise ValueError(
                "kv_layout 'virtual' is implemented on CPU only (an anonymous mmap); the CUDA "
                "virtual memory management path is not implemented"
            )
        if self.config.max_num_seqs is None:
            raise ValueError("kv_layout 'virtual' sizes its slots by max_num_seqs: give it")
        shape = self.kv_shape
        element = torch.empty((), dtype=shape.dtype).element_size()
        self.geometry = virtual_geometry(
            self.config.max_num_seqs,
            self.max_model_len,
            shape.block_size,
            shape.block_size * shape.num_kv_heads * shape.head_dim * element,
        )
        self.pool = VirtualKVPool(
            shape.num_layers,
            self.geometry.num_blocks,
            shape.block_size,
            shape.num_kv_heads,
            shape.head_dim,
            shape.dtype,
        )
        return self.pool.tensor

    def released(self, block_tables: Sequence[Sequence[int]]) -> None:
        """Hands back the slot of every released sequence that was given blocks."""
        assert self.pool is not None and self.geometry is not None, "pool not allocated"
        slot_blocks = self.geometry.slot_blocks
        slots = [(table[0] // slot_blocks) * slot_blocks for table in block_tables if table]
        self.pool.decommit([(first, first + slot_blocks) for first in slots])
        self._returned += len(slots)

    @property
    def returned_ranges(self) -> int:
        return self._returned

    def resident_bytes(self) -> int | None:
        return None if self.pool is None else self.pool.resident_bytes()

    def release(self) -> None:
        self.pool = None
