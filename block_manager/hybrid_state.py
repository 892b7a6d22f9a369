"""One sequence's state under the hybrid manager, and the rules on which blocks a group keeps.

A sequence has one token list and one hash chain, and one block table per KV group
(`workers.kv_groups`). Group `g`'s table has `ceil(num_tokens / block_size)` entries like any
table; entries a sliding group no longer needs hold the manager's null block id (never
allocated, never written, all zeros on the workers), which owns no reference.

What a sliding group of window `w` keeps: every later query of the sequence is at a position
`>= num_computed` (the next step's first query; a prefill chunk's later queries and a decode's
speculative drafts are further right), and a query at `p` reads keys `(p - w, p]`. So keys
below `num_computed - w + 1` are never read again, and block `i` may be dropped once
`(i + 1) * block_size <= num_computed - w + 1`, i.e. `i < first_kept(num_computed)`.
Every position `[num_computed, num_tokens)` is written this or a later step, so its block is
always held. A prefix-cache hit of `k` blocks is a sequence computed up to `k * block_size`:
the same rule gives the blocks a sliding group needs from the cache.

The workers receive the tables interleaved (`flat[i * G + g]` is group `g`'s block `i`), so one
`(start, blocks)` splice keeps all of them in step: appending a block appends `G` entries, and
dropping or replacing group `g`'s block `i` lowers `synced` to `i * G + g`.
"""

from __future__ import annotations

from array import array

from block_manager.identity import block_key, block_suffix, new_token_array, tokens_to_bytes


def first_kept(window: int | None, num_computed: int, block_size: int) -> int:
    """Index of the first block a group of `window` (None: full attention) still reads once
    `num_computed` tokens are computed (see the module docstring)."""
    if window is None:
        return 0
    return max(0, num_computed - window + 1) // block_size


def group_tag(group: int) -> bytes:
    """The bytes that put group `group`'s sealed blocks in their own part of the hash index:
    one token-content key names different layers' KV in each group."""
    return group.to_bytes(2, "little")


class HybridSeq:
    """What the hybrid manager keeps for one sequence (see the module docstring).

    Invariants: every `tables[g]` has `ceil(len(tokens) / block_size)` entries; a null entry
    only below `first_kept` of a sliding group; `dropped[g]` entries of group `g` from the
    front are null (none after them); `on_cpu[g][i]` (while swapped out) says whether
    `tables[g][i]` is a CPU block; `synced` entries of the interleaved table are the workers'.
    """

    __slots__ = (
        "dropped",
        "hash_seed",
        "hash_suffix",
        "hashes",
        "num_computed",
        "on_cpu",
        "synced",
        "tables",
        "tokens",
        "unsalted_blocks",
    )

    def __init__(
        self,
        tokens: array,
        tables: list[list[int]],
        dropped: list[int],
        *,
        num_computed: int,
        hashes: list[bytes],
        hash_seed: bytes,
        hash_suffix: bytes,
        unsalted_blocks: int,
    ) -> None:
        self.tokens = tokens
        self.tables = tables
        self.dropped = dropped
        self.num_computed = num_computed
        self.hashes = hashes
        self.hash_seed = hash_seed
        self.hash_suffix = hash_suffix
        self.unsalted_blocks = unsalted_blocks
        self.on_cpu: list[list[bool]] | None = None
        self.synced = 0

    def fork(self) -> HybridSeq:
        """A copy sharing the same physical ids (the caller adds the references)."""
        return HybridSeq(
            new_token_array(self.tokens),
            [list(table) for table in self.tables],
            list(self.dropped),
            num_computed=self.num_computed,
            hashes=list(self.hashes),
            hash_seed=self.hash_seed,
            hash_suffix=self.hash_suffix,
            unsalted_blocks=self.unsalted_blocks,
        )

    def num_blocks(self) -> int:
        return len(self.tables[0])

    def lower_synced(self, group: int, index: int) -> None:
        """Entry `index` of group `group` changed: the workers' copy is good only before it."""
        self.synced = min(self.synced, index * len(self.tables) + group)

    def interleaved(self, start: int = 0) -> list[int]:
        """The workers' view of the tables from flat entry `start` on."""
        tables, groups = self.tables, len(self.tables)
        end = len(tables[0]) * groups
        return [tables[flat % groups][flat // groups] for flat in range(start, end)]

    def sealed_key(self, index: int, block_size: int) -> bytes:
        """The (untagged) hash preimage of sealed block `index`."""
        parent = self.hashes[index - 1] if index else self.hash_seed
        chunk = self.tokens[index * block_size : (index + 1) * block_size]
        suffix = block_suffix(index, self.hash_suffix, self.unsalted_blocks)
        return block_key(parent, tokens_to_bytes(chunk), suffix)
