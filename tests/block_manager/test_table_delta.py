"""Manager-owned table deltas (`take_table_delta`) and the paged `KVManager` contract.

The workers keep a copy of each sequence's block table and get only what changed; the manager
knows every place a table changes (append, copy-on-write, sealing dedup, fork, free, swap), so
the scheduler never copies or diffs whole tables.
"""

from __future__ import annotations

import pytest

from block_manager import (
    CacheKey,
    InvalidOperation,
    KVCacheManager,
    KVManager,
)
from block_manager.protocol import block_events_of, cache_tier_of
from tests.block_manager.helpers import SEED, make_manager, prefill

KEY = CacheKey(SEED)


def test_first_delta_is_the_whole_table_then_only_appended_blocks() -> None:
    manager = make_manager(device=8, block_size=4)
    prefill(manager, 1, [1, 2, 3, 4, 5, 6])
    assert manager.take_table_delta(1) == (0, manager.block_table(1))
    assert manager.take_table_delta(1) == (2, [])  # nothing changed
    manager.append_token(1, 7)
    manager.append_token(1, 8)
    assert manager.take_table_delta(1) == (2, [])  # the tail had room
    manager.append_token(1, 9)
    assert manager.take_table_delta(1) == (2, [manager.block_table(1)[2]])
    manager.check_integrity()


def test_copy_on_write_replaces_the_tail_in_the_delta() -> None:
    manager = make_manager(device=8, block_size=4)
    prefill(manager, 1, [1, 2, 3, 4, 5, 6])
    parent = manager.take_table_delta(1)[1]
    manager.fork(1, 2)
    assert manager.take_table_delta(2) == (0, parent)  # a child is new to the workers
    copy = manager.append_token(1, 7)
    assert copy is not None
    assert manager.take_table_delta(1) == (1, [copy.dst])
    assert manager.take_table_delta(2) == (2, [])  # the other holder kept the original
    manager.check_integrity()


def test_sealing_dedup_replaces_a_block_below_the_workers_end() -> None:
    manager = make_manager(device=8, block_size=4)
    prompt = [1, 2, 3, 4, 5, 6]
    manager.allocate(1, prompt, KEY)
    manager.allocate(2, prompt, KEY)
    before = manager.take_table_delta(2)[1]
    manager.mark_computed(1, 6)
    manager.mark_computed(2, 6)  # block 0 now shares sequence 1's copy
    assert manager.take_table_delta(2) == (0, manager.block_table(2))
    assert manager.block_table(2)[1:] == before[1:]
    manager.check_integrity()


def test_free_and_swap_reset_the_workers_view() -> None:
    manager = make_manager(device=8, cpu=8, block_size=4)
    prefill(manager, 1, list(range(9)))
    manager.take_table_delta(1)
    manager.swap_out([1])
    with pytest.raises(InvalidOperation, match="swapped out"):
        manager.take_table_delta(1)
    manager.swap_in([1])
    assert manager.take_table_delta(1) == (0, manager.block_table(1))
    manager.free(1)
    with pytest.raises(InvalidOperation, match="unknown"):
        manager.take_table_delta(1)
    prefill(manager, 1, list(range(5)))
    assert manager.take_table_delta(1) == (0, manager.block_table(1))
    manager.check_integrity()


def test_the_paged_manager_satisfies_the_contract_and_its_optional_pieces() -> None:
    manager = make_manager(device=8, block_size=4)
    assert isinstance(manager, KVManager)
    assert cache_tier_of(manager) is manager
    assert block_events_of(manager) is manager


def test_paged_usage_is_its_pressure_in_slots() -> None:
    manager: KVCacheManager = make_manager(device=8, block_size=4)
    prefill(manager, 1, [1, 2, 3, 4, 5, 6])
    manager.fork(1, 2)
    usage, pressure = manager.usage(), manager.pressure()
    assert usage.reserved_slots == usage.backed_slots == pressure.token_slots_allocated == 8
    assert usage.live_slots == pressure.tokens_held == 6
    assert usage.internal_fragmentation_slots == pressure.waste_slots == 2
    assert usage.reservation_waste_slots == 0
    assert usage.pool_slots == 32
