"""Exact scenarios: LRU eviction, prefix hits, copy-on-write, failures, swaps, pressure."""

from __future__ import annotations

import pytest

from block_manager import BlockCopy, CacheKey, NeverFits, NoFreeBlocks
from tests.block_manager.helpers import OTHER_SEED, SEED, make_manager, observe, prefill


def test_prefill_allocates_by_length_and_decode_fills_the_tail() -> None:
    manager = make_manager(device=8, block_size=4)
    assert manager.allocate(1, [1, 2, 3, 4, 5, 6], CacheKey(SEED)) == 0
    assert manager.block_table(1) == [0, 1]
    assert manager.num_computed_tokens(1) == 0
    assert manager.slot_mapping(1, 0, 6) == [0, 1, 2, 3, 4, 5]
    manager.mark_computed(1, 6)
    assert manager.append_token(1, 7) is None
    assert manager.append_token(1, 8) is None
    assert manager.block_table(1) == [0, 1]  # the tail had room
    assert manager.append_token(1, 9) is None
    assert manager.block_table(1) == [0, 1, 2]  # allocated only when the tail was full
    assert manager.slot_mapping(1, 6, 9) == [6, 7, 8]
    assert manager.num_tokens(1) == 9
    assert manager.token_ids(1) == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    manager.check_integrity()


def test_slot_mapping_follows_non_contiguous_blocks() -> None:
    manager = make_manager(device=8, block_size=4)
    prefill(manager, 1, [1] * 4)
    prefill(manager, 2, [2] * 4)
    manager.free(1)  # block 0 stays cached but is reusable
    prefill(manager, 3, [3] * 12)
    table = manager.block_table(3)
    expected = [block * 4 + offset for block in table for offset in range(4)]
    assert manager.slot_mapping(3, 0, 12) == expected
    assert manager.slot_mapping(3, 5, 10) == expected[5:10]
    assert manager.slot_mapping(3, 7, 7) == []


def test_lru_eviction_order_and_unsealed_blocks_reused_first() -> None:
    manager = make_manager(device=6, block_size=2)
    prefill(manager, 1, [1, 1, 1, 1, 1])  # blocks 0,1 sealed; block 2 partial
    prefill(manager, 2, [2, 2, 2, 2, 2])  # blocks 3,4 sealed; block 5 partial
    manager.free(1)
    manager.free(2)
    # Unsealed tails first (most recently freed at the very front), then sealed blocks in
    # least-recently-freed order, each sequence's later blocks before its prefix.
    assert manager._device.free_queue() == [5, 2, 1, 0, 4, 3]
    pressure = manager.pressure()
    assert (pressure.device.free, pressure.device.evictable_cached) == (2, 4)
    manager.check_integrity()
    # A 6-token prompt of new tokens takes 3 blocks: both unsealed ones, then evicts block 1.
    prefill(manager, 3, [9] * 6)
    assert manager.block_table(3) == [5, 2, 1]
    # Sequence 1's first block is still cached: a prompt starting with it hits block 0.
    assert manager.allocate(4, [1, 1, 7], CacheKey(SEED)) == 2
    assert manager.block_table(4)[0] == 0
    # Sequence 1's second block was evicted: this prompt hits only its first block.
    manager.free(4)
    assert manager.allocate(5, [1, 1, 1, 1, 7], CacheKey(SEED)) == 2
    manager.check_integrity()


def test_prefix_hit_after_the_holder_finished() -> None:
    manager = make_manager(device=8, block_size=4)
    prompt = list(range(10))
    assert prefill(manager, 1, prompt) == 0
    blocks = manager.block_table(1)
    manager.free(1)
    assert manager.num_free_device_blocks() == 8
    # Same prompt: the two full blocks are hits; the partial tail is recomputed.
    assert manager.allocate(2, prompt, CacheKey(SEED)) == 8
    assert manager.block_table(2)[:2] == blocks[:2]
    assert manager.num_computed_tokens(2) == 8
    pressure = manager.pressure()
    assert (pressure.prefix_query_tokens, pressure.prefix_hit_tokens) == (20, 8)
    manager.check_integrity()


def test_prefix_hit_never_covers_the_last_token() -> None:
    manager = make_manager(device=8, block_size=4)
    prefill(manager, 1, list(range(8)))
    assert manager.allocate(2, list(range(8)), CacheKey(SEED)) == 4
    assert manager.block_table(2)[0] == manager.block_table(1)[0]
    assert manager.block_table(2)[1] != manager.block_table(1)[1]
    manager.check_integrity()


def test_uncomputed_blocks_are_never_hit() -> None:
    manager = make_manager(device=8, block_size=4)
    manager.allocate(1, list(range(9)), CacheKey(SEED))
    assert manager.allocate(2, list(range(9)), CacheKey(SEED)) == 0
    manager.mark_computed(1, 6)  # only block 0 is fully computed
    assert manager.allocate(3, list(range(9)), CacheKey(SEED)) == 4
    manager.check_integrity()


@pytest.mark.parametrize(
    ("seed", "extra", "tokens"),
    [
        (OTHER_SEED, (), list(range(9))),
        (SEED, ("tenant-b",), list(range(9))),
        (SEED, (), list(range(9))),
        (SEED, ("tenant-a",), [0, 1, 2, 99, 4, 5, 6, 7, 8]),
    ],
)
def test_lookup_misses_when_identity_salt_or_a_token_differs(
    seed: bytes, extra: tuple[str, ...], tokens: list[int]
) -> None:
    manager = make_manager(device=8, block_size=4)
    prefill(manager, 1, list(range(9)), extra_keys=("tenant-a",))
    assert manager.allocate(2, tokens, CacheKey(seed, extra)) == 0
    assert manager.allocate(3, list(range(9)), CacheKey(SEED, ("tenant-a",))) == 8


def test_copy_on_write_of_a_forked_partial_tail() -> None:
    manager = make_manager(device=8, block_size=4)
    prefill(manager, 1, [1, 2, 3, 4, 5, 6])  # blocks [0, 1]; block 1 holds 2 tokens
    manager.fork(1, 2)
    manager.fork(1, 3)
    assert manager.block_table(2) == manager.block_table(3) == [0, 1]
    # The first writer gets a private copy of the 2 valid tokens; the others keep block 1.
    assert manager.append_token(2, 70) == BlockCopy(src=1, dst=2, num_tokens=2)
    assert manager.block_table(2) == [0, 2]
    assert manager.block_table(1) == manager.block_table(3) == [0, 1]
    assert manager.append_token(3, 80) == BlockCopy(src=1, dst=3, num_tokens=2)
    assert manager.block_table(3) == [0, 3]
    # The last holder writes in place.
    assert manager.append_token(1, 60) is None
    assert manager.block_table(1) == [0, 1]
    assert manager.token_ids(2)[-1] == 70
    assert manager.pressure().cow_copies == 2
    manager.check_integrity()


def test_fork_of_a_full_tail_allocates_without_copy() -> None:
    manager = make_manager(device=8, block_size=4)
    prefill(manager, 1, [1, 2, 3, 4])
    manager.fork(1, 2)
    assert manager.append_token(1, 5) is None
    assert manager.append_token(2, 6) is None
    assert manager.block_table(1)[0] == manager.block_table(2)[0]
    assert manager.block_table(1)[1] != manager.block_table(2)[1]
    assert manager.pressure().cow_copies == 0
    manager.check_integrity()


def test_can_append_counts_new_tails_and_copies() -> None:
    manager = make_manager(device=4, block_size=4)
    prefill(manager, 1, [1, 2, 3, 4, 5, 6])  # 2 blocks
    manager.fork(1, 2)
    manager.fork(1, 3)
    # 2 free blocks: all three writers need 2 copies (the last keeps the tail) -> fits.
    assert manager.can_append([1, 2, 3])
    assert manager.can_append([2])
    manager.free(3)
    prefill(manager, 4, [9])  # 1 free block left
    assert manager.can_append([1, 2])  # one copy
    assert manager.can_append([1, 2, 4])  # 4 has room in its tail
    prefill(manager, 5, [8])  # 0 free
    assert not manager.can_append([1])
    with pytest.raises(NoFreeBlocks) as failure:
        manager.append_token(1, 7)
    assert failure.value.tier == "device"


def test_failed_operations_leave_everything_unchanged() -> None:
    manager = make_manager(device=4, cpu=1, block_size=4, watermark=1)
    prefill(manager, 1, [1, 2, 3, 4, 5])  # 2 blocks
    manager.fork(1, 2)
    before = observe(manager, [1, 2, 3])
    with pytest.raises(NoFreeBlocks) as failure:
        manager.allocate(3, list(range(8)), CacheKey(SEED))  # 2 needed, 2 free, watermark 1
    assert (failure.value.needed, failure.value.available) == (2, 1)
    assert observe(manager, [1, 2, 3]) == before
    assert not manager.can_allocate(list(range(8)), CacheKey(SEED))
    assert manager.can_allocate(list(range(4)), CacheKey(SEED))
    with pytest.raises(NeverFits):
        manager.allocate(3, list(range(17)), CacheKey(SEED))
    assert observe(manager, [1, 2, 3]) == before
    with pytest.raises(NoFreeBlocks) as swap_failure:
        manager.swap_out([1, 2])  # 2 blocks to move, 1 CPU block
    assert swap_failure.value.tier == "cpu"
    assert not manager.can_swap_out([1, 2])
    assert observe(manager, [1, 2, 3]) == before
    prefill(manager, 3, [7, 7, 7, 7])  # 1 free block left: the watermark reserve
    assert manager.append_token(3, 7) is None  # decode may use the reserve
    assert manager.num_free_device_blocks() == 0
    before = observe(manager, [1, 2, 3])
    with pytest.raises(NoFreeBlocks):
        manager.append_token(2, 9)  # copy-on-write needs a block
    assert observe(manager, [1, 2, 3]) == before
    assert manager.token_ids(2) == [1, 2, 3, 4, 5]
    manager.check_integrity()


def test_swap_round_trip_preserves_table_order_and_shares_once() -> None:
    manager = make_manager(device=8, cpu=8, block_size=2)
    prefill(manager, 1, [1, 2, 3, 4, 5])  # 3 blocks, tail partial
    manager.fork(1, 2)
    manager.append_token(2, 9)  # copy-on-write: 2 now has a private tail
    before = {seq: manager.block_table(seq) for seq in (1, 2)}
    pairs = manager.swap_out([1, 2])
    # Shared blocks 0 and 1 move once; each private tail moves.
    assert sorted(device for device, _ in pairs) == sorted({*before[1], *before[2]})
    assert len({cpu for _, cpu in pairs}) == len(pairs)
    assert manager.is_swapped(1) and manager.is_swapped(2)
    assert manager.pressure().cpu.used == 4
    manager.check_integrity()
    # Occupy the freed device blocks with unrelated work, then swap back in.
    prefill(manager, 3, [8, 8, 8])
    back = manager.swap_in([1, 2])
    cpu_of = dict(pairs)
    device_of = {cpu: device for cpu, device in back}
    for seq in (1, 2):
        # Same logical order: logical block i lands where its CPU copy of before[i] went.
        restored = manager.block_table(seq)
        for old, new in zip(before[seq], restored, strict=True):
            assert new == old or device_of.get(cpu_of[old]) == new
    assert manager.block_table(1)[:2] == manager.block_table(2)[:2]
    assert manager.pressure().cpu.used == 0
    counters = manager.pressure()
    assert counters.swap_out_blocks == 4
    # The sealed shared blocks were still cached on the device: only the two tails are copied.
    assert counters.swap_in_blocks == len(back) == 2
    assert manager.block_table(1)[:2] == before[1][:2]
    manager.check_integrity()


def test_swap_in_reuses_cached_device_blocks_without_copying() -> None:
    manager = make_manager(device=8, cpu=8, block_size=2)
    prefill(manager, 1, [1, 2, 3, 4, 5])  # blocks 0, 1 sealed; 2 partial
    table = manager.block_table(1)
    pairs = manager.swap_out([1])
    assert len(pairs) == 3
    back = manager.swap_in([1])  # the sealed blocks are still cached on the device
    assert len(back) == 1  # only the unsealed tail is copied
    assert manager.block_table(1)[:2] == table[:2]
    manager.check_integrity()


def test_blocks_shared_outside_the_group_stay_on_device() -> None:
    manager = make_manager(device=8, cpu=8, block_size=2)
    prefill(manager, 1, [1, 2, 3, 4, 5])
    manager.fork(1, 2)
    pairs = manager.swap_out([1])  # every block is shared with 2: nothing moves
    assert pairs == []
    assert manager.is_swapped(1)
    manager.check_integrity()
    manager.append_token(2, 6)  # swapped 1 still holds the shared tail: copy-on-write
    assert manager.pressure().cow_copies == 1
    assert manager.swap_in([1]) == []
    assert manager.block_table(1) == [0, 1, 2]
    manager.check_integrity()


def test_pressure_counts_waste_once_per_shared_tail() -> None:
    manager = make_manager(device=8, block_size=4)
    prefill(manager, 1, [1, 2, 3, 4, 5])  # 2 blocks, 3 slots wasted
    manager.fork(1, 2)
    pressure = manager.pressure()
    assert pressure.device.used == 2
    assert pressure.token_slots_allocated == 8
    assert pressure.tokens_held == 5
    assert pressure.waste_slots == 3
    assert pressure.kv_utilization == pytest.approx(5 / 8)
    assert pressure.num_sequences == 2
    assert pressure.device.total == 8
    assert pressure.device.available == manager.num_free_device_blocks() == 6
    device, cpu = pressure.device, pressure.cpu
    assert (device.total, device.used, device.free) == (8, 2, 6)
    assert (cpu.total, cpu.used, cpu.free) == (8, 0, 8)
    assert device.evictable_cached == cpu.evictable_cached == 0
    assert pressure.prefix_hit_rate == 0.0


def test_prefix_caching_disabled_never_hits() -> None:
    manager = make_manager(device=8, block_size=4, caching=False)
    prefill(manager, 1, list(range(9)))
    manager.free(1)
    assert manager.allocate(2, list(range(9)), CacheKey(SEED)) == 0
    assert manager.pressure().device.evictable_cached == 0
    manager.check_integrity()


def test_same_content_computed_twice_is_deduplicated_at_sealing() -> None:
    manager = make_manager(device=8, block_size=4)
    prompt = [1, 2, 3, 4, 5, 6]
    manager.allocate(1, prompt, CacheKey(SEED))
    manager.allocate(2, prompt, CacheKey(SEED))  # nothing computed yet: no hit
    assert manager.block_table(1)[0] != manager.block_table(2)[0]
    manager.mark_computed(1, 6)
    own_block = manager.block_table(2)[0]
    manager.mark_computed(2, 6)
    # Sequence 2's first block holds the same KV as sequence 1's: it shares that one instead.
    assert manager.block_table(2)[0] == manager.block_table(1)[0]
    assert manager._device.free_queue()[0] == own_block
    manager.check_integrity()
    manager.free(1)
    # The shared sealed block is still held by 2, so it stays findable.
    assert manager.allocate(3, prompt, CacheKey(SEED)) == 4


def test_blocks_needed_counts_reclaimed_cached_blocks() -> None:
    manager = make_manager(device=4, block_size=4)
    prefill(manager, 1, list(range(9)))  # blocks 0, 1 sealed; 2 is the partial tail
    manager.free(1)
    assert manager._device.free_queue() == [2, 3, 1, 0]
    # A hit on a free cached block still takes it out of the free queue.
    assert manager.blocks_needed_to_allocate(list(range(9)), CacheKey(SEED)) == 3
    assert manager.cached_prefix_tokens(list(range(9)), CacheKey(SEED)) == 8
    prefill(manager, 2, [50] * 12)  # takes 2, 3, then evicts the LRU cached block 1
    assert manager.block_table(2) == [2, 3, 1]
    manager.free(2)
    assert manager.allocate(3, list(range(9)), CacheKey(SEED)) == 4  # only block 0 is left
    manager.free(3)
    prefill(manager, 4, list(range(9)))
    manager.fork(4, 5)
    # Both full blocks are now held: a new copy of the prompt needs only its own tail.
    assert manager.blocks_needed_to_allocate(list(range(9)), CacheKey(SEED)) == 1
    assert manager.can_allocate(list(range(9)), CacheKey(SEED))
    manager.check_integrity()


def test_pools_are_preallocated_and_never_grow() -> None:
    manager = make_manager(device=8, cpu=4, block_size=4)
    pool = manager._device
    arrays = (pool.ref_counts, pool.hashes, pool.keys, pool._prev, pool._next)
    lengths = [len(array) for array in arrays]
    for round_ in range(20):
        prefill(manager, round_, [round_ % 3] * 9)
        manager.fork(round_, 100 + round_)
        manager.append_token(100 + round_, 1)
        manager.swap_out([round_])
        manager.swap_in([round_])
        manager.free(round_)
        manager.free(100 + round_)
    assert [len(array) for array in arrays] == lengths
    assert (pool.ref_counts, pool.hashes, pool.keys, pool._prev, pool._next) == arrays
    assert all(
        new is old
        for new, old in zip(
            (pool.ref_counts, pool.hashes, pool.keys, pool._prev, pool._next), arrays, strict=True
        )
    )
    manager.check_integrity()
