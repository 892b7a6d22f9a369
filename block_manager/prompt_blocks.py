"""Which blocks of a prompt are cacheable, and their chain hashes: the rule, written once.

A prompt's cacheable blocks are its full blocks except the one holding its last token (that
token's KV is computed in the step that samples the first output token, so a prefix hit always
leaves at least one token to compute). The first `key.unsalted_blocks` of them are hashed without
the key's extra keys (an operator-shared prefix), the rest with them. `KVCacheManager` looks up
exactly these blocks; the router's prefix index publishes exactly these hashes.
"""

from __future__ import annotations

from collections.abc import Sequence

from block_manager.cache_key import CacheKey
from block_manager.errors import InvalidOperation
from block_manager.identity import (
    chain_blocks,
    check_hash_seed,
    encode_extra_keys,
    new_token_array,
    tokens_to_bytes,
)


def cacheable_blocks(num_tokens: int, block_size: int) -> int:
    """Leading blocks of a `num_tokens` prompt a prefix lookup may hit: its full blocks, except
    the one holding the last token (0 for an empty prompt)."""
    return max(0, (num_tokens - 1) // block_size)


def prompt_block_hashes(token_ids: Sequence[int], key: CacheKey, block_size: int) -> list[bytes]:
    """Chain hashes of the prompt's cacheable blocks, exactly as the block manager keys them.

    Raises `InvalidOperation` for a bad block size, seed, extra key or token id (as `allocate`
    would).
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise InvalidOperation(f"block_size must be an int >= 1, got {block_size!r}")
    count = cacheable_blocks(len(token_ids), block_size)
    if count == 0:
        return []
    seed = check_hash_seed(key.hash_seed)
    suffix = encode_extra_keys(key.extra_keys)
    tokens = new_token_array(token_ids[: count * block_size])
    _, digests = chain_blocks(
        seed, tokens_to_bytes(tokens), block_size, suffix, key.unsalted_blocks
    )
    return digests


def prompt_block_keys(
    token_ids: Sequence[int], key: CacheKey, block_size: int
) -> tuple[list[bytes], list[bytes]]:
    """Hash preimages and chain hashes of the prompt's cacheable blocks (`prompt_block_hashes`
    with the preimages a peer looks its blocks up by)."""
    count = cacheable_blocks(len(token_ids), block_size)
    if count == 0:
        return [], []
    seed = check_hash_seed(key.hash_seed)
    suffix = encode_extra_keys(key.extra_keys)
    tokens = new_token_array(token_ids[: count * block_size])
    return chain_blocks(seed, tokens_to_bytes(tokens), block_size, suffix, key.unsalted_blocks)
