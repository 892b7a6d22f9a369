"""Argument checks shared by the manager: each raises `InvalidOperation` naming the problem."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from block_manager.errors import InvalidOperation
from block_manager.table import BlockTable
from block_manager.types import SeqId


def check_count(name: str, value: int, *, minimum: int) -> int:
    """`value` must be an int (not a bool) and at least `minimum`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidOperation(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise InvalidOperation(f"{name} must be >= {minimum}, got {value}")
    return value


def check_manager_sizes(
    num_device_blocks: int, num_cpu_blocks: int, block_size: int, watermark_blocks: int
) -> None:
    """Pool sizes, a power-of-two block size and a watermark below the device pool size."""
    check_count("num_device_blocks", num_device_blocks, minimum=1)
    check_count("num_cpu_blocks", num_cpu_blocks, minimum=0)
    check_count("block_size", block_size, minimum=1)
    if block_size & (block_size - 1):
        raise InvalidOperation(f"block_size must be a power of two, got {block_size}")
    check_count("watermark_blocks", watermark_blocks, minimum=0)
    if watermark_blocks >= num_device_blocks:
        raise InvalidOperation(
            f"watermark_blocks ({watermark_blocks}) must be < num_device_blocks "
            f"({num_device_blocks})"
        )


def check_new_seq_id(tables: Mapping[SeqId, BlockTable], seq_id: SeqId) -> None:
    """A new sequence id is an int that no live sequence uses."""
    if isinstance(seq_id, bool) or not isinstance(seq_id, int):
        raise InvalidOperation(f"sequence id must be an int, got {seq_id!r}")
    if seq_id in tables:
        raise InvalidOperation(f"sequence {seq_id!r} already exists")


def unknown_sequence(seq_id: SeqId) -> InvalidOperation:
    return InvalidOperation(f"unknown sequence {seq_id!r} (never allocated or already freed)")


def swap_group(
    tables: Mapping[SeqId, BlockTable], seq_ids: Sequence[SeqId], *, swapped: bool
) -> list[BlockTable]:
    """The tables of a non-empty group of distinct sequences, all swapped out or all resident."""
    if isinstance(seq_ids, int):
        raise InvalidOperation("pass a sequence of sequence ids, e.g. [seq_id]")
    if not seq_ids:
        raise InvalidOperation("a swap group needs at least one sequence")
    if len(set(seq_ids)) != len(seq_ids):
        raise InvalidOperation(f"duplicate sequence ids in {list(seq_ids)!r}")
    group = []
    for seq_id in seq_ids:
        table = tables.get(seq_id)
        if table is None:
            raise unknown_sequence(seq_id)
        if (table.on_cpu is not None) != swapped:
            state = "already swapped out" if not swapped else "not swapped out"
            raise InvalidOperation(f"sequence {seq_id!r} is {state}")
        group.append(table)
    return group
