"""Bad input raises a clear `InvalidOperation` and corrupts nothing."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from block_manager import CacheKey, InvalidOperation, KVCacheManager
from tests.block_manager.helpers import SEED, make_manager, observe, prefill


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_device_blocks": 0}, "num_device_blocks must be >= 1"),
        ({"num_device_blocks": -4}, "num_device_blocks must be >= 1"),
        ({"num_cpu_blocks": -1}, "num_cpu_blocks must be >= 0"),
        ({"block_size": 0}, "block_size must be >= 1"),
        ({"block_size": -16}, "block_size must be >= 1"),
        ({"block_size": 12}, "power of two"),
        ({"block_size": 16.0}, "must be an int"),
        ({"num_device_blocks": True}, "must be an int"),
        ({"watermark_blocks": -1}, "watermark_blocks must be >= 0"),
        ({"watermark_blocks": 8}, "must be < num_device_blocks"),
    ],
)
def test_constructor_rejects_bad_sizes(kwargs: dict[str, object], message: str) -> None:
    arguments: dict[str, object] = {"num_device_blocks": 8, "num_cpu_blocks": 4, "block_size": 4}
    arguments.update(kwargs)
    with pytest.raises(InvalidOperation, match=message):
        KVCacheManager(**arguments)  # type: ignore[arg-type]


def _state() -> KVCacheManager:
    manager = make_manager(device=8, cpu=4, block_size=4)
    prefill(manager, 1, [1, 2, 3, 4, 5])
    manager.allocate(2, [6, 7, 8], CacheKey(SEED))
    manager.allocate(3, [9, 9, 9, 9, 9, 9], CacheKey(SEED))
    manager.mark_computed(3, 6)
    manager.swap_out([3])
    return manager


Operation = Callable[[KVCacheManager], object]

BAD_OPERATIONS: list[tuple[str, Operation, str]] = [
    ("unknown sequence", lambda m: m.append_token(99, 1), "unknown sequence 99"),
    ("unknown free", lambda m: m.free(99), "unknown sequence 99"),
    ("unknown table", lambda m: m.block_table(99), "unknown sequence 99"),
    ("unknown slots", lambda m: m.slot_mapping(99, 0, 1), "unknown sequence 99"),
    ("unknown mark", lambda m: m.mark_computed(99, 1), "unknown sequence 99"),
    ("unknown query", lambda m: m.num_tokens(99), "unknown sequence 99"),
    ("duplicate id", lambda m: m.allocate(1, [1], CacheKey(SEED)), "already exists"),
    ("bad id type", lambda m: m.allocate("7", [1], CacheKey(SEED)), "must be an int"),  # type: ignore[arg-type]
    ("empty prompt", lambda m: m.allocate(7, [], CacheKey(SEED)), "empty sequence"),
    ("negative token", lambda m: m.allocate(7, [1, -2], CacheKey(SEED)), r"\[0, 2\*\*32\)"),
    ("float token", lambda m: m.allocate(7, [1.5], CacheKey(SEED)), r"\[0, 2\*\*32\)"),
    ("bad seed", lambda m: m.allocate(7, [1], CacheKey(b"x")), "32 bytes"),
    ("str seed", lambda m: m.allocate(7, [1], CacheKey("s" * 32)), "32 bytes"),  # type: ignore[arg-type]
    ("bad salt", lambda m: m.allocate(7, [1], CacheKey(SEED, "salt")), "sequence"),
    ("append bad token", lambda m: m.append_token(1, -1), r"\[0, 2\*\*32\)"),
    ("append swapped", lambda m: m.append_token(3, 1), "swapped out"),
    ("table swapped", lambda m: m.block_table(3), "swapped out"),
    ("slots swapped", lambda m: m.slot_mapping(3, 0, 1), "swapped out"),
    ("mark swapped", lambda m: m.mark_computed(3, 6), "swapped out"),
    ("fork swapped", lambda m: m.fork(3, 7), "swapped out"),
    ("slots past end", lambda m: m.slot_mapping(1, 3, 6), "outside sequence 1"),
    ("slots negative", lambda m: m.slot_mapping(1, -1, 2), "outside sequence 1"),
    ("slots reversed", lambda m: m.slot_mapping(1, 3, 2), "outside sequence 1"),
    ("mark backwards", lambda m: m.mark_computed(1, 4), r"must be in \[5, 5\]"),
    ("mark past end", lambda m: m.mark_computed(2, 4), r"must be in \[0, 3\]"),
    ("mark float", lambda m: m.mark_computed(2, 2.0), "num_computed_tokens"),  # type: ignore[arg-type]
    ("fork uncomputed", lambda m: m.fork(2, 7), "uncomputed tokens"),
    ("fork into existing", lambda m: m.fork(1, 2), "already exists"),
    ("swap out swapped", lambda m: m.swap_out([3]), "already swapped out"),
    ("swap in resident", lambda m: m.swap_in([1]), "not swapped out"),
    ("swap duplicate", lambda m: m.swap_out([1, 1]), "duplicate"),
    ("swap empty", lambda m: m.swap_out([]), "at least one"),
    ("swap bare id", lambda m: m.swap_out(1), "sequence of sequence ids"),  # type: ignore[arg-type]
    ("swap unknown", lambda m: m.swap_in([3, 99]), "unknown sequence 99"),
    ("append duplicate", lambda m: m.can_append([1, 1]), "duplicate"),
]


@pytest.mark.parametrize(
    ("operation", "message"),
    [(op, msg) for _, op, msg in BAD_OPERATIONS],
    ids=[name for name, _, _ in BAD_OPERATIONS],
)
def test_bad_operation_raises_and_changes_nothing(operation: Operation, message: str) -> None:
    manager = _state()
    before = observe(manager, [1, 2, 3, 7])
    with pytest.raises(InvalidOperation, match=message):
        operation(manager)
    assert observe(manager, [1, 2, 3, 7]) == before
    manager.check_integrity()


def test_double_free_is_rejected() -> None:
    manager = _state()
    manager.free(1)
    before = observe(manager, [1, 2, 3])
    with pytest.raises(InvalidOperation, match="already freed"):
        manager.free(1)
    assert observe(manager, [1, 2, 3]) == before
    manager.free(3)  # a swapped-out sequence can be freed
    manager.check_integrity()
    assert manager.pressure().cpu.used == 0
