"""Per-sequence block table: logical block index -> physical block id, plus the tokens.

Invariants (checked by `block_manager.integrity`):
- ``len(block_ids) == ceil(len(token_ids) / block_size)``: only the last block (the tail) can be
  partial, and only positions ``[num_computed, num_tokens)`` and the tail's free slots are writable;
- ``hashes[i]`` is the chain hash of full block ``i`` for ``i < len(hashes)`` and those blocks are
  computed; blocks ``i < unsalted_blocks`` (an operator-shared prefix, whole prompt blocks only)
  are hashed without the extra keys ``hash_suffix``, the rest with them
  (``len(hashes) * block_size <= num_computed``); sealed blocks are never written again;
- ``on_cpu`` is None while the sequence is device-resident; while swapped out, ``on_cpu[i]`` says
  whether ``block_ids[i]`` is a CPU block (moved) or a device block it still shares with others;
- ``synced <= len(block_ids)``: the workers' copy of the table equals ``block_ids[:synced]`` (0 for
  a new, forked or swapped-out table; lowered whenever an entry below it is replaced).
"""

from __future__ import annotations

from array import array

from block_manager.identity import block_key, block_suffix, new_token_array, tokens_to_bytes


class BlockTable:
    """The state the manager keeps for one sequence."""

    __slots__ = (
        "block_ids",
        "hash_seed",
        "hash_suffix",
        "hashes",
        "num_computed",
        "on_cpu",
        "synced",
        "tokens",
        "unsalted_blocks",
    )

    def __init__(
        self,
        tokens: array,
        block_ids: list[int],
        *,
        num_computed: int,
        hashes: list[bytes],
        hash_seed: bytes,
        hash_suffix: bytes,
        unsalted_blocks: int = 0,
    ) -> None:
        self.tokens = tokens
        self.block_ids = block_ids
        self.num_computed = num_computed
        self.hashes = hashes
        self.hash_seed = hash_seed
        self.hash_suffix = hash_suffix
        self.unsalted_blocks = unsalted_blocks
        self.on_cpu: list[bool] | None = None
        self.synced = 0

    def fork(self) -> BlockTable:
        """A copy sharing the same physical ids (the caller adds the references)."""
        child = BlockTable(
            new_token_array(self.tokens),
            list(self.block_ids),
            num_computed=self.num_computed,
            hashes=list(self.hashes),
            hash_seed=self.hash_seed,
            hash_suffix=self.hash_suffix,
            unsalted_blocks=self.unsalted_blocks,
        )
        return child

    def sealed_key(self, index: int, block_size: int) -> bytes | None:
        """The hash preimage of sealed block `index` (None if the block is not sealed)."""
        if index >= len(self.hashes):
            return None
        parent = self.hashes[index - 1] if index else self.hash_seed
        chunk = self.tokens[index * block_size : (index + 1) * block_size]
        suffix = block_suffix(index, self.hash_suffix, self.unsalted_blocks)
        return block_key(parent, tokens_to_bytes(chunk), suffix)

    def device_blocks(self) -> list[int]:
        """The device block ids this table references (all of them unless swapped out)."""
        if self.on_cpu is None:
            return self.block_ids
        return [b for b, cpu in zip(self.block_ids, self.on_cpu, strict=True) if not cpu]

    def cpu_blocks(self) -> list[int]:
        """The CPU block ids this table references (none unless swapped out)."""
        if self.on_cpu is None:
            return []
        return [b for b, cpu in zip(self.block_ids, self.on_cpu, strict=True) if cpu]
