"""Routing by prefix: a prompt's block hashes (`block_manager.prompt_block_hashes`, what the
ingress sends the directory) against an independent implementation of the published hash
formula and against the block manager's own cache hits; the router's `PrefixIndex` of recent
routes against a plain list-and-dict model under random operations (Hypothesis)."""

from __future__ import annotations

import hashlib
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import block_manager
from block_manager import CacheIdentity, CacheKey, KVCacheManager
from cluster.engine.generate_request import leading_shared_tokens
from cluster.serving.prefix_index import PrefixIndex

SEED = CacheIdentity(model_weights_digest="w", tokenizer_digest="t", block_size=4).digest()
SALT = b"tenant:" + bytes(range(32))


def prompt_block_hashes(
    tokens: list[int],
    *,
    hash_seed: bytes,
    extra_keys: list[bytes] | tuple[bytes, ...],
    block_size: int,
    shared_prefix_blocks: int = 0,
) -> list[bytes]:
    key = CacheKey(hash_seed, tuple(extra_keys), shared_prefix_blocks)
    return block_manager.prompt_block_hashes(tokens, key, block_size)


def shared_prefix_blocks(tokens: list[int], prefixes: list[list[int]], block_size: int) -> int:
    return leading_shared_tokens(tokens, prefixes, block_size) // block_size


def spec_hash(parent: bytes, tokens: list[int], extra: list[bytes]) -> bytes:
    """The block hash as the block manager's docs define it, written out independently."""
    body = struct.pack("<I", len(tokens)) + b"".join(struct.pack("<I", t) for t in tokens)
    if extra:
        keys = struct.pack("<I", len(extra))
        keys += b"".join(b"b" + struct.pack("<I", len(k)) + k for k in extra)
    else:
        keys = struct.pack("<I", 0)
    return hashlib.sha256(parent + body + keys).digest()


@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), min_size=0, max_size=30),
    block_size=st.sampled_from([1, 2, 4, 8]),
    salted=st.booleans(),
    shared=st.integers(0, 4),
)
def test_hashes_follow_the_published_formula(
    tokens: list[int], block_size: int, salted: bool, shared: int
) -> None:
    extra = [SALT] if salted else []
    got = prompt_block_hashes(
        tokens,
        hash_seed=SEED,
        extra_keys=extra,
        block_size=block_size,
        shared_prefix_blocks=shared,
    )
    expected, parent = [], SEED
    for index in range(max(0, (len(tokens) - 1) // block_size)):  # never the last token's block
        block = tokens[index * block_size : (index + 1) * block_size]
        parent = spec_hash(parent, block, [] if index < shared else extra)
        expected.append(parent)
    assert got == expected


@pytest.mark.parametrize("salt", [None, SALT])
def test_shared_leading_hashes_are_exactly_the_block_managers_cache_hits(
    salt: bytes | None,
) -> None:
    extra = [salt] if salt else []
    manager = KVCacheManager(num_device_blocks=64, num_cpu_blocks=0, block_size=4)
    first = list(range(100, 123))  # 5 full blocks + 3 tokens
    manager.allocate(0, first, CacheKey(SEED, extra))
    manager.mark_computed(0, len(first))
    manager.free(0)
    published = prompt_block_hashes(first, hash_seed=SEED, extra_keys=extra, block_size=4)
    for diverge_at in [0, 3, 4, 9, 16, 22]:
        other = first[:diverge_at] + [7] * (23 - diverge_at)
        hashes = prompt_block_hashes(other, hash_seed=SEED, extra_keys=extra, block_size=4)
        common = next(
            (i for i, (a, b) in enumerate(zip(published, hashes, strict=False)) if a != b),
            min(len(published), len(hashes)),
        )
        hits = manager.cached_prefix_tokens(other, CacheKey(SEED, extra))
        assert hits == common * 4
    other_tenant = prompt_block_hashes(first, hash_seed=SEED, extra_keys=[b"x"], block_size=4)
    assert not set(other_tenant) & set(published)


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="block_size"):
        prompt_block_hashes([1, 2], hash_seed=SEED, extra_keys=(), block_size=0)
    with pytest.raises(ValueError, match="capacity"):
        PrefixIndex(0)


class ModelIndex:
    """The same behaviour, written as plainly as possible: a recency list and a dict."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.order: list[bytes] = []
        self.holders: dict[bytes, set[str]] = {}

    def record(self, replica: str, hashes: list[bytes]) -> None:
        for h in hashes:
            if h in self.holders:
                self.order.remove(h)
            else:
                self.holders[h] = set()
            self.order.append(h)
            self.holders[h].add(replica)
        while len(self.order) > self.capacity:
            del self.holders[self.order.pop(0)]

    def remove(self, replica: str, keep: set[bytes]) -> None:
        for h in list(self.order):
            if h not in keep:
                self.holders[h].discard(replica)
                if not self.holders[h]:
                    del self.holders[h]
                    self.order.remove(h)

    def longest(self, hashes: list[bytes]) -> dict[str, int]:
        result = {}
        for replica in {r for held in self.holders.values() for r in held}:
            n = 0
            while n < len(hashes) and replica in self.holders.get(hashes[n], set()):
                n += 1
            if n:
                result[replica] = n
        return result


HASHES = [bytes([i]) * 32 for i in range(8)]
chains = st.lists(st.sampled_from(HASHES), max_size=6)
operations = st.lists(
    st.tuples(st.sampled_from(["record", "forget"]), st.sampled_from("abc"), chains),
    max_size=25,
)


@settings(deadline=None)
@given(capacity=st.integers(1, 8), ops=operations, query=chains)
def test_prefix_index_matches_a_plain_model(
    capacity: int, ops: list[tuple[str, str, list[bytes]]], query: list[bytes]
) -> None:
    index, model = PrefixIndex(capacity), ModelIndex(capacity)
    for op, replica, hashes in ops:
        if op == "record":
            index.record(replica, hashes)
            model.record(replica, hashes)
        else:
            index.forget(replica)
            model.remove(replica, set())
        assert len(index) == len(model.order) <= capacity
        assert index.longest_prefixes(query) == model.longest(query)


def test_shared_prefix_blocks_count_only_whole_blocks_of_an_operator_prefix() -> None:
    system = list(range(50, 61))  # 11 tokens
    assert shared_prefix_blocks([*system, 1, 2, 3], [system], 4) == 2  # 11 -> 2 whole blocks
    assert shared_prefix_blocks(system[:9] + [0] * 9, [system], 4) == 2  # diverges at token 9
    assert shared_prefix_blocks(system[:7] + [0] * 9, [system, [9, 9]], 4) == 1
    assert shared_prefix_blocks([1, 2, 3, 4, 5], [system], 4) == 0
    shared = prompt_block_hashes(
        [*system, 1, 2], hash_seed=SEED, extra_keys=[b"alice"], block_size=4, shared_prefix_blocks=2
    )
    other = prompt_block_hashes(
        [*system, 1, 2], hash_seed=SEED, extra_keys=[b"bob"], block_size=4, shared_prefix_blocks=2
    )
    assert shared[:2] == other[:2] and shared[2] != other[2]  # only the operator's blocks match
