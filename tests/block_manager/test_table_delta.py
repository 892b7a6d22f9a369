"""Manager-owned table deltas (`take_table_delta`) and the one `KVManager` contract.

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
from kv_layouts.contiguous import ContiguousKVManager
from kv_layouts.virtual import VirtualKVManager
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


def _range_managers() -> list[KVManager]:
    return [
        ContiguousKVManager(num_device_blocks=32, block_size=4, max_model_len=64),
        VirtualKVManager(
            num_device_blocks=32, block_size=4, max_model_len=64, num_slots=2, slot_blocks=16
        ),
    ]


@pytest.mark.parametrize("manager", _range_managers(), ids=["contiguous", "virtual"])
def test_range_layouts_report_appended_blocks_only(manager: KVManager) -> None:
    manager.reserve(1, 20)
    manager.allocate(1, [1, 2, 3, 4, 5], KEY)
    table = manager.block_table(1)
    assert manager.take_table_delta(1) == (0, table)
    manager.mark_computed(1, 5)
    for token in range(4):  # 9 tokens: a third block
        manager.append_token(1, token)
    assert manager.take_table_delta(1) == (2, [table[0] + 2])
    assert manager.take_table_delta(1) == (3, [])
    manager.free(1)
    manager.forget(1)
    manager.allocate(1, [1], KEY)
    assert manager.take_table_delta(1) == (0, manager.block_table(1))


def test_every_layout_satisfies_the_contract_with_its_own_hooks() -> None:
    paged = make_manager(device=8, block_size=4)
    contiguous, virtual = _range_managers()
    managers: list[KVManager] = [paged, contiguous, virtual]
    for manager in managers:
        assert isinstance(manager, KVManager)
    assert [m.layout for m in managers] == ["paged", "contiguous", "virtual"]
    assert [m.can_fork for m in managers] == [True, False, False]
    paged.reserve(1, 100)  # a no-op: the paged layout reserves nothing
    prefill(paged, 1, [1, 2, 3, 4, 5, 6])
    paged.forget(1)
    paged.free(1)
    assert paged.take_decommits() == [] and not paged.has_pending_decommits()
    contiguous.allocate(1, [1, 2], KEY)
    contiguous.free(1)
    assert contiguous.take_decommits() == [] and not contiguous.has_pending_decommits()
    virtual.allocate(1, [1, 2], KEY)
    virtual.free(1)
    assert virtual.has_pending_decommits()
    assert virtual.take_decommits() == [(0, 1)]
    assert not virtual.has_pending_decommits()


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
