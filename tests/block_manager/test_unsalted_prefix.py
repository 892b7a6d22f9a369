"""Exact scenarios for an operator-shared prefix: the first `unsalted_blocks` full blocks are
hashed without the extra keys (tenant salt), every later block with them.

The oracle is the published hash chain (`block_hash`) and the hits of plain unsalted and salted
sequences: an unsalted block must be found by every tenant and by a sequence with no extra keys
at all, a salted block only by its own tenant.
"""

from __future__ import annotations

import pytest

from block_manager import CacheKey, InvalidOperation, KVCacheManager, block_hash
from tests.block_manager.helpers import SEED, make_manager, observe

BLOCK = 4
SYSTEM = [11, 12, 13, 14, 15, 16, 17, 18]  # two full blocks shared on purpose
QUESTION = [21, 22, 23, 24, 25]  # one full block and a tail, private to each tenant
PROMPT = SYSTEM + QUESTION
SALT_A, SALT_B = (b"tenant:a",), (b"tenant:b",)


def prefill(
    manager: KVCacheManager, seq_id: int, tokens: list[int], salt: tuple[bytes, ...], unsalted: int
) -> int:
    """Allocate and compute a whole prompt with `unsalted` shared blocks; returns hits."""
    cached = manager.allocate(seq_id, tokens, CacheKey(SEED, salt, unsalted))
    manager.mark_computed(seq_id, len(tokens))
    manager.check_integrity()
    return cached


def test_tenants_share_the_unsalted_blocks_and_nothing_after() -> None:
    manager = make_manager(block_size=BLOCK)
    assert prefill(manager, 1, PROMPT, SALT_A, unsalted=2) == 0
    assert prefill(manager, 2, PROMPT, SALT_B, unsalted=2) == len(SYSTEM)
    table_a, table_b = manager.block_table(1), manager.block_table(2)
    assert table_a[:2] == table_b[:2]  # the system prompt's blocks, one physical copy
    assert table_a[2] != table_b[2]  # the question's block is salted per tenant
    # The same tenant again hits its own salted block too.
    assert prefill(manager, 3, PROMPT, SALT_A, unsalted=2) == 3 * BLOCK
    assert manager.block_table(3)[:3] == table_a[:3]


def test_without_unsalted_blocks_tenants_share_nothing() -> None:
    manager = make_manager(block_size=BLOCK)
    prefill(manager, 1, PROMPT, SALT_A, unsalted=0)
    assert prefill(manager, 2, PROMPT, SALT_B, unsalted=0) == 0
    # A sequence that declares a shared prefix does not find blocks sealed salted either.
    assert prefill(manager, 3, PROMPT, SALT_B, unsalted=2) == 0


def test_unsalted_blocks_hash_like_a_sequence_without_extra_keys() -> None:
    """The unsalted part is exactly the plain chain: a no-extra-key sequence hits it, and the
    planning queries agree with `allocate`."""
    manager = make_manager(block_size=BLOCK)
    prefill(manager, 1, PROMPT, SALT_A, unsalted=2)
    plain = CacheKey(SEED, ())
    assert manager.cached_prefix_tokens(PROMPT, plain) == len(SYSTEM)
    salted_b = CacheKey(SEED, SALT_B, 2)
    assert manager.cached_prefix_tokens(PROMPT, salted_b) == len(SYSTEM)
    needed = manager.blocks_needed_to_allocate(PROMPT, salted_b)
    assert needed == 4 - 2  # four blocks, two found
    assert manager.can_allocate(PROMPT, salted_b)
    free_before = manager.num_free_device_blocks()
    assert manager.allocate(4, PROMPT, salted_b) == len(SYSTEM)
    assert free_before - manager.num_free_device_blocks() == needed


def test_sealed_hashes_follow_the_published_chain() -> None:
    """Block i's preimage starts with block i-1's hash, so a lookup seeded with a hash computed
    independently by `block_hash` finds the block only if the manager chained it the same way:
    two unsalted blocks, then salted ones."""
    manager = make_manager(block_size=BLOCK)
    prefill(manager, 1, PROMPT, SALT_A, unsalted=2)
    table = manager.block_table(1)
    h0 = block_hash(SEED, SYSTEM[:4])
    h1 = block_hash(h0, SYSTEM[4:])
    tail = [*QUESTION, 0]  # a longer prompt so the block can be hit
    # Block 1 under seed h0, no extra keys; block 2 under seed h1 with tenant A's salt.
    assert manager.cached_prefix_tokens([*SYSTEM[4:], 0], CacheKey(h0)) == BLOCK
    assert manager.cached_prefix_tokens(tail, CacheKey(h1, SALT_A)) == BLOCK
    assert manager.cached_prefix_tokens(tail, CacheKey(h1)) == 0  # block 2 is salted
    assert manager.cached_prefix_tokens([*SYSTEM[4:], 0], CacheKey(h0, SALT_A)) == 0
    manager.allocate(2, tail, CacheKey(h1, SALT_A))
    assert manager.block_table(2)[0] == table[2]
    # Declaring a longer shared prefix looks block 2 up unsalted: a miss there.
    assert manager.cached_prefix_tokens(PROMPT, CacheKey(SEED, SALT_A, 3)) == len(SYSTEM)


def test_decode_blocks_after_the_prefix_are_salted() -> None:
    manager = make_manager(block_size=BLOCK)
    prefill(manager, 1, PROMPT, SALT_A, unsalted=2)
    for token in (26, 27, 28):  # fills block 3
        manager.append_token(1, token)
    manager.mark_computed(1, len(PROMPT) + 3)
    manager.check_integrity()
    longer = [*PROMPT, 26, 27, 28, 29]
    assert prefill(manager, 2, longer, SALT_B, unsalted=2) == len(SYSTEM)
    assert prefill(manager, 3, longer, SALT_A, unsalted=2) == 4 * BLOCK


def test_fork_and_swap_keep_the_split() -> None:
    """Forks inherit the split; swap-out re-seals cached blocks from the table's keys, and the
    blocks sealed after a swap-in still verify (check_integrity recomputes every chain)."""
    manager = make_manager(block_size=BLOCK, device=16, cpu=8)
    prefill(manager, 1, PROMPT, SALT_A, unsalted=2)
    manager.fork(1, 2)
    for token in (26, 27, 28):
        manager.append_token(2, token)
    manager.mark_computed(2, len(PROMPT) + 3)
    manager.check_integrity()
    manager.free(1)
    manager.swap_out([2])
    manager.check_integrity()
    manager.swap_in([2])
    manager.check_integrity()
    manager.append_token(2, 29)
    manager.mark_computed(2, len(PROMPT) + 4)
    manager.check_integrity()
    assert prefill(manager, 3, [*PROMPT, 26, 27, 28, 29, 0], SALT_B, unsalted=2) == len(SYSTEM)


@pytest.mark.parametrize("unsalted", [-1, 4, 1.0, True, "2"])
def test_bad_unsalted_blocks_are_refused_with_nothing_changed(unsalted: object) -> None:
    manager = make_manager(block_size=BLOCK)
    prefill(manager, 1, PROMPT, SALT_A, unsalted=2)
    before = observe(manager, [1, 2])
    with pytest.raises(InvalidOperation, match="unsalted_blocks"):
        manager.allocate(2, PROMPT, CacheKey(SEED, SALT_B, unsalted))  # type: ignore[arg-type]
    with pytest.raises(InvalidOperation, match="unsalted_blocks"):
        manager.can_allocate(PROMPT, CacheKey(SEED, unsalted_blocks=unsalted))  # type: ignore[arg-type]
    assert observe(manager, [1, 2]) == before
    manager.check_integrity()
