"""The KV directory's index against a plain model (per replica and tier, a set of hashes), under
random event batches, gaps, snapshots and drops (Hypothesis); plus its bounds and expiry."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from block_manager import BlockEvent
from cluster.serving.directory_index import DirectoryIndex, PoolView, PrefixHolding

HASHES = [bytes([i]) * 32 for i in range(10)]
POOL = PoolView()


def stored(*indices: int, tier: str = "device") -> list[BlockEvent]:
    return [BlockEvent(True, HASHES[i], tier) for i in indices]  # type: ignore[arg-type]


def removed(*indices: int, tier: str = "device") -> list[BlockEvent]:
    return [BlockEvent(False, HASHES[i], tier) for i in indices]  # type: ignore[arg-type]


def joined(index: DirectoryIndex, *replicas: str) -> None:
    for replica in replicas:
        index.snapshot(replica, 1, {"device": [], "cpu": []}, POOL, now_s=0.0)


def test_leading_blocks_per_replica_and_tier() -> None:
    index = DirectoryIndex()
    joined(index, "a", "b")
    assert index.apply("a", 2, stored(0, 1, 2), POOL, now_s=0.0)
    assert index.apply("b", 2, stored(0) + stored(1, tier="cpu") + stored(3), POOL, now_s=0.0)
    assert index.query(HASHES[:4]) == {"a": PrefixHolding(3, 3), "b": PrefixHolding(2, 1)}
    assert index.apply("a", 3, removed(1), POOL, now_s=0.0)
    assert index.query(HASHES[:4]) == {"a": PrefixHolding(1, 1), "b": PrefixHolding(2, 1)}
    assert index.query([HASHES[5]]) == {}
    assert index.stats().entries_by_replica == {
        "a": {"device": 2, "cpu": 0},
        "b": {"device": 2, "cpu": 1},
    }


def test_a_gap_or_unknown_replica_is_refused_until_a_snapshot() -> None:
    index = DirectoryIndex()
    assert not index.apply("a", 1, stored(0), POOL)  # never joined
    joined(index, "a")
    assert not index.apply("a", 3, stored(0), POOL)  # batch 2 was lost
    assert index.query(HASHES[:1]) == {}  # nothing applied from a refused batch
    assert index.stats().resyncs_requested == 2
    index.snapshot("a", 7, {"device": [HASHES[0]], "cpu": [HASHES[1]]}, POOL)
    assert index.query(HASHES[:2]) == {"a": PrefixHolding(2, 1)}
    assert not index.apply("a", 7, stored(2), POOL)  # a replayed batch
    assert index.apply("a", 8, stored(2), POOL)


def test_entries_are_bounded_least_recently_used_first() -> None:
    index = DirectoryIndex(max_entries=3)
    joined(index, "a")
    index.apply("a", 2, stored(0, 1, 2), POOL)
    index.query([HASHES[0]])  # a hit refreshes HASHES[0]
    index.apply("a", 3, stored(3), POOL)  # HASHES[1] is now the least recently used
    assert index.stats().entries == 3 and index.stats().evicted_entries == 1
    assert index.query([HASHES[0]]) == {"a": PrefixHolding(1, 1)}
    assert index.query([HASHES[1]]) == {}
    assert index.stats().entries_by_replica["a"]["device"] == 3


def test_silent_and_dropped_replicas_lose_their_entries() -> None:
    index = DirectoryIndex(replica_timeout_s=5.0)
    joined(index, "a", "b")
    index.apply("a", 2, stored(0), POOL, now_s=0.0)
    index.apply("b", 2, stored(0), POOL, now_s=4.0)
    assert index.expire(now_s=6.0) == ["a"]
    assert index.query([HASHES[0]]) == {"b": PrefixHolding(1, 1)}
    index.drop("b")
    assert index.query([HASHES[0]]) == {} and index.stats().entries == 0
    with pytest.raises(ValueError, match="max_entries"):
        DirectoryIndex(max_entries=0)


events = st.lists(
    st.tuples(st.booleans(), st.integers(0, len(HASHES) - 1), st.sampled_from(["device", "cpu"])),
    max_size=12,
)
steps = st.lists(
    st.tuples(
        st.sampled_from(["a", "b", "c"]),
        st.sampled_from(["batch", "batch", "batch", "gap", "snapshot", "drop"]),
        events,
    ),
    max_size=30,
)


@settings(deadline=None)
@given(steps=steps, chain_len=st.integers(1, len(HASHES)))
def test_the_index_matches_a_plain_model(
    steps: list[tuple[str, str, list[tuple[bool, int, str]]]], chain_len: int
) -> None:
    index = DirectoryIndex()
    model: dict[str, dict[str, set[bytes]]] = {}
    seqs: dict[str, int] = {}
    for replica, kind, raw in steps:
        batch = [BlockEvent(s, HASHES[i], t) for s, i, t in raw]  # type: ignore[arg-type]
        if kind == "drop":
            index.drop(replica)
            model.pop(replica, None)
            seqs.pop(replica, None)
        elif kind == "snapshot" or replica not in seqs:
            held = {"device": set(), "cpu": set()}
            for event in batch:
                (held[event.tier].add if event.stored else held[event.tier].discard)(
                    event.block_hash
                )
            seqs[replica] = 1
            index.snapshot(replica, 1, {t: sorted(h) for t, h in held.items()}, POOL)
            model[replica] = held
        elif kind == "gap":
            assert not index.apply(replica, seqs[replica] + 2, batch, POOL)
        else:
            seqs[replica] += 1
            assert index.apply(replica, seqs[replica], batch, POOL)
            for event in batch:
                tier = model[replica][event.tier]
                (tier.add if event.stored else tier.discard)(event.block_hash)
    chain = HASHES[:chain_len]
    expected = {}
    for replica, tiers in model.items():
        blocks = next(
            (n for n, h in enumerate(chain) if h not in tiers["device"] | tiers["cpu"]),
            len(chain),
        )
        device = next((n for n, h in enumerate(chain) if h not in tiers["device"]), len(chain))
        if blocks:
            expected[replica] = PrefixHolding(blocks, min(device, blocks))
    assert index.query(chain) == expected
