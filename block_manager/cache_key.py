"""`CacheKey`: what seeds and salts one request's block hashes, as one value.

The managers take it whole (`allocate(seq_id, token_ids, key)`), and `prompt_block_hashes`
derives a prompt's chain from it, so the engine, the scheduler and the router never pass its
fields apart.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CacheKey:
    """A request's cache identity: `hash_seed` (a `CacheIdentity.digest()`, 32 bytes) chains its
    blocks, `extra_keys` (e.g. the tenant salt) go into every block's hash except the first
    `unsalted_blocks` full blocks (an operator-shared prefix, the same for every tenant).

    Invariant: two prompts share a cached block only when their keys agree on everything that
    block's hash depends on. Fields are validated where they are used (the managers raise
    `InvalidOperation` naming a bad one), so building a key stays free on hot paths.
    """

    hash_seed: bytes
    extra_keys: Sequence[str | bytes] = ()
    unsalted_blocks: int = 0
