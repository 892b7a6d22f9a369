"""How `group_layers` groups a model's layers into KV groups of equal size."""

from __future__ import annotations

from workers.kv_groups import KVGroupLayout, full_layout, group_layers


def _pairs(layout: KVGroupLayout) -> set[tuple[int, int]]:
    return set(zip(layout.layer_group, layout.layer_slot, strict=True))


def test_gemma3_pattern_gives_one_layer_groups() -> None:
    windows = (8, 8, 8, 8, 8, None, 8)
    layout = group_layers(windows)
    assert layout.slots == 1
    assert layout.windows == (8, 8, 8, 8, 8, None, 8)
    assert layout.layer_group == tuple(range(7)) and layout.hybrid


def test_alternating_layers_share_rows_across_groups() -> None:
    """Gemma 2: three sliding and three full layers, groups of three, one row each."""
    layout = group_layers((4, None, 4, None, 4, None))
    assert layout.slots == 3 and layout.windows == (4, None)
    assert layout.layer_group == (0, 1, 0, 1, 0, 1)
    assert layout.layer_slot == (0, 0, 1, 1, 2, 2)
    assert len(_pairs(layout)) == 6


def test_uneven_kinds_leave_a_short_last_group() -> None:
    layout = group_layers((8, 8, 8, None, None, 8, 8))
    assert layout.slots == 2
    assert layout.windows == (8, 8, None, 8)  # [0, 1], [2, 5], [3, 4], [6] by first layer
    assert layout.layer_group == (0, 0, 1, 2, 2, 1, 3)
    assert layout.layer_slot == (0, 1, 0, 0, 1, 1, 0)
    assert len(_pairs(layout)) == 7 and layout.slots * layout.num_groups >= 7


def test_uniform_window_is_one_sliding_group_and_no_window_is_the_full_layout() -> None:
    layout = group_layers((16, 16, 16))
    assert layout.windows == (16,) and layout.slots == 3 and layout.hybrid
    assert group_layers((None, None)) == full_layout(2)
    assert group_layers((4, None), enabled=False) == full_layout(2)
    assert not full_layout(2).hybrid
