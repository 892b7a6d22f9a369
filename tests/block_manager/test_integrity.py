"""`check_integrity()` itself: it passes on healthy state and names each corruption it finds.

These tests break internals on purpose (the only place tests touch private state) to prove the
checker can fail.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from block_manager import CacheKey, IntegrityError, KVCacheManager
from tests.block_manager.helpers import SEED, make_manager, prefill


def _healthy() -> KVCacheManager:
    manager = make_manager(device=8, cpu=4, block_size=4)
    prefill(manager, 1, [1, 2, 3, 4, 5, 6])
    manager.fork(1, 2)
    prefill(manager, 3, [7, 7, 7, 7, 7])
    manager.free(3)
    manager.allocate(4, [8, 8, 8, 8, 8], CacheKey(SEED))
    manager.swap_out([4])
    manager.check_integrity()
    return manager


def _bump_ref(m: KVCacheManager) -> None:
    m._device.ref_counts[0] += 1


def _free_but_referenced(m: KVCacheManager) -> None:
    m._device.ref_counts[m.block_table(1)[0]] = 0


def _broken_link(m: KVCacheManager) -> None:
    queue = m._device.free_queue()
    m._device._prev[queue[1]] = queue[-1]


def _wrong_hash(m: KVCacheManager) -> None:
    m._tables[1].hashes[0] = bytes(32)


def _shared_writable(m: KVCacheManager) -> None:
    # Pretend sequence 2 has not computed its shared tail: two writers on one block.
    m._tables[2].num_computed = 4


def _lost_cpu_reference(m: KVCacheManager) -> None:
    m._cpu.ref_counts[m._tables[4].block_ids[0]] = 0


def _counter_drift(m: KVCacheManager) -> None:
    m._device.num_free += 1


def _table_too_short(m: KVCacheManager) -> None:
    m._tables[1].tokens.append(9)
    m._tables[1].tokens.append(9)
    m._tables[1].tokens.append(9)


CORRUPTIONS: list[tuple[Callable[[KVCacheManager], None], str]] = [
    (_bump_ref, "ref count"),
    (_free_but_referenced, "ref count"),
    (_broken_link, "prev link"),
    (_wrong_hash, "cached under a different hash"),
    (_shared_writable, "writable device block"),
    (_lost_cpu_reference, "cpu block"),
    (_counter_drift, "num_free"),
    (_table_too_short, "blocks for"),
]


@pytest.mark.parametrize(
    ("corrupt", "message"), CORRUPTIONS, ids=[c.__name__ for c, _ in CORRUPTIONS]
)
def test_check_integrity_detects(corrupt: Callable[[KVCacheManager], None], message: str) -> None:
    manager = _healthy()
    corrupt(manager)
    with pytest.raises(IntegrityError, match=message):
        manager.check_integrity()


def test_hash_chain_verification_detects_a_changed_token() -> None:
    manager = _healthy()
    manager._tables[1].tokens[0] = 42  # the sealed block's hash no longer matches its tokens
    manager.check_integrity(verify_hashes=False)
    with pytest.raises(IntegrityError, match="recomputed chain"):
        manager.check_integrity()
