"""The baselines' managers keep the `KVManager` contract the scheduler codes against: table
deltas report appended blocks only, placeholders are replaced like the paged manager's, and
what they lack (forks, the CPU tier, block events) is said once by their `KVLayout`, not by
do-nothing hooks."""

from __future__ import annotations

import pytest

from block_manager import CacheKey, KVManager
from block_manager.protocol import block_events_of, cache_tier_of
from kv_layouts import LAYOUT_NAMES, layout_named
from kv_layouts.contiguous import ContiguousKVManager
from kv_layouts.virtual import VirtualKVManager
from tests.block_manager.helpers import SEED
from tests.block_manager.test_replace_token import (
    check_a_replaced_placeholder_is_the_token_appended_directly,
    check_only_uncomputed_tokens_can_be_replaced,
)
from tests.layouts.bounds import DictBounds

KEY = CacheKey(SEED)


def _range_managers() -> list[KVManager]:
    bounds = DictBounds({1: 20, 2: 20})
    return [
        ContiguousKVManager(num_device_blocks=32, block_size=4, max_model_len=64, bounds=bounds),
        VirtualKVManager(
            num_device_blocks=32,
            block_size=4,
            max_model_len=64,
            num_slots=2,
            slot_blocks=16,
            bounds=bounds,
        ),
    ]


@pytest.mark.parametrize("manager", _range_managers(), ids=["contiguous", "virtual"])
def test_range_layouts_report_appended_blocks_only(manager: KVManager) -> None:
    manager.allocate(1, [1, 2, 3, 4, 5], KEY)
    table = manager.block_table(1)
    assert manager.take_table_delta(1) == (0, table)
    manager.mark_computed(1, 5)
    for token in range(4):  # 9 tokens: a third block
        manager.append_token(1, token)
    assert manager.take_table_delta(1) == (2, [table[0] + 2])
    assert manager.take_table_delta(1) == (3, [])
    manager.free(1)
    manager.allocate(1, [1], KEY)
    assert manager.take_table_delta(1) == (0, manager.block_table(1))


@pytest.mark.parametrize("manager", _range_managers(), ids=["contiguous", "virtual"])
def test_a_replaced_placeholder_is_the_token_appended_directly(manager: KVManager) -> None:
    check_a_replaced_placeholder_is_the_token_appended_directly(manager)


@pytest.mark.parametrize("manager", _range_managers(), ids=["contiguous", "virtual"])
def test_only_uncomputed_tokens_can_be_replaced(manager: KVManager) -> None:
    check_only_uncomputed_tokens_can_be_replaced(manager)


def test_every_layout_is_found_by_name_and_says_what_it_can_do() -> None:
    assert LAYOUT_NAMES == ("paged", "contiguous", "virtual")
    layouts = [layout_named(name) for name in LAYOUT_NAMES]
    assert [layout.name for layout in layouts] == list(LAYOUT_NAMES)
    assert [layout.can_fork for layout in layouts] == [True, False, False]
    assert [layout.has_swap_tier for layout in layouts] == [True, False, False]
    assert [layout.shares_prefixes for layout in layouts] == [True, False, False]
    with pytest.raises(ValueError, match="kv_layout 'segmented' is not one of"):
        layout_named("segmented")


def test_the_baselines_satisfy_the_contract_without_the_optional_pieces() -> None:
    for manager in _range_managers():
        assert isinstance(manager, KVManager)
        assert cache_tier_of(manager) is None
        assert block_events_of(manager) is None


def test_a_sequence_without_a_bound_reserves_the_model_context() -> None:
    """The bound comes from the engine's request; a sequence it does not know reserves the
    most it could ever hold, the model's context."""
    manager = ContiguousKVManager(
        num_device_blocks=32, block_size=4, max_model_len=64, bounds=DictBounds({1: 20})
    )
    manager.allocate(1, [1, 2], KEY)
    manager.allocate(2, [1, 2], KEY)
    assert manager.range_of(1) == (0, 5)  # 20 tokens
    assert manager.range_of(2) == (5, 21)  # 64 tokens
