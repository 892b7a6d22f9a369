"""`replace_token`: async scheduling appends a placeholder for a token still being sampled and
writes the real id in once it is known. Oracle: a sequence that appended the real id directly
(same tokens, same hashes, same table), on the paged layout (`tests/layouts` runs the same
checks on the baselines)."""

from __future__ import annotations

import pytest

from block_manager import (
    CacheKey,
    InvalidOperation,
    KVManager,
)
from tests.block_manager.helpers import SEED, make_manager

KEY = CacheKey(SEED)
PROMPT = [5, 6, 7, 8, 9, 10, 11]


def check_a_replaced_placeholder_is_the_token_appended_directly(manager: KVManager) -> None:
    for seq_id in (1, 2):
        manager.allocate(seq_id, PROMPT, KEY)
        manager.mark_computed(seq_id, len(PROMPT))
    manager.append_token(1, 42)
    manager.append_token(2, 0)  # the placeholder: a block is taken for it all the same
    table_before = manager.block_table(2)
    manager.replace_token(2, len(PROMPT), 42)
    assert manager.block_table(2) == table_before  # only the id changed
    for seq_id in (1, 2):
        manager.mark_computed(seq_id, len(PROMPT) + 1)  # seals the full second block
    assert manager.token_ids(2) == manager.token_ids(1) == [*PROMPT, 42]  # type: ignore[attr-defined]
    manager.check_integrity()


def check_only_uncomputed_tokens_can_be_replaced(manager: KVManager) -> None:
    manager.allocate(1, PROMPT, KEY)
    manager.mark_computed(1, len(PROMPT))
    manager.append_token(1, 0)
    for position in (len(PROMPT) - 1, len(PROMPT) + 1, -1):
        with pytest.raises(InvalidOperation, match="only its uncomputed"):
            manager.replace_token(1, position, 3)
    with pytest.raises(InvalidOperation, match="token id"):
        manager.replace_token(1, len(PROMPT), -5)
    assert manager.token_ids(1) == [*PROMPT, 0]  # type: ignore[attr-defined]
    manager.check_integrity()


def test_a_replaced_placeholder_is_the_token_appended_directly() -> None:
    check_a_replaced_placeholder_is_the_token_appended_directly(
        make_manager(device=16, block_size=4)
    )


def test_only_uncomputed_tokens_can_be_replaced() -> None:
    check_only_uncomputed_tokens_can_be_replaced(make_manager(device=16, block_size=4))


def test_a_replaced_token_is_hashed_as_the_real_one() -> None:
    """The paged layout seals blocks by content: the block the placeholder completed is found
    by a prompt holding the real token, so the placeholder id never reached a hash."""
    manager = make_manager(device=16, block_size=4)
    manager.allocate(1, PROMPT, KEY)
    manager.mark_computed(1, len(PROMPT))
    manager.append_token(1, 0)
    manager.replace_token(1, len(PROMPT), 42)
    manager.mark_computed(1, len(PROMPT) + 1)
    assert manager.allocate(2, [*PROMPT, 42, 1], KEY) == 8  # both full blocks hit
    assert manager.block_table(2)[:2] == manager.block_table(1)
    manager.check_integrity()
