"""The contiguous and virtual managers against naive models (Hypothesis state machines).

Contiguous: an occupancy bitmap and a linear scan for the lowest fitting run (first fit) say
where each reservation must land and whether it fits at all. Virtual: a slot set and a sum of
page-rounded commitments say whether admission and growth fit the physical budget, and each
free must hand back exactly its committed range.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from block_manager import CacheKey, NeverFits, NoFreeBlocks
from block_manager.protocol import block_events_of
from kv_layouts.contiguous import ContiguousKVManager
from kv_layouts.virtual import VirtualKVManager
from tests.layouts.bounds import DictBounds

SEED = b"\x01" * 32
BLOCK = 4
POOL = 24
MAX_LEN = 40


def first_fit(occupied: list[bool], length: int) -> int | None:
    for start in range(len(occupied) - length + 1):
        if not any(occupied[start : start + length]):
            return start
    return None


class ContiguousMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.bounds = DictBounds()
        self.manager = ContiguousKVManager(
            num_device_blocks=POOL, block_size=BLOCK, max_model_len=MAX_LEN, bounds=self.bounds
        )
        self.occupied = [False] * POOL
        self.seqs: dict[int, tuple[int, int, int]] = {}  # seq -> (first, blocks, tokens)
        self.next_id = 0

    @rule(prompt=st.integers(1, 20), extra=st.integers(0, 30))
    def allocate(self, prompt: int, extra: int) -> None:
        seq_id = self.next_id
        self.next_id += 1
        limit = min(prompt + extra, MAX_LEN)
        self.bounds[seq_id] = prompt + extra
        blocks = -(-max(limit, prompt + 1) // BLOCK)
        expected = first_fit(self.occupied, blocks)
        try:
            self.manager.allocate(seq_id, [5] * prompt, CacheKey(SEED))
        except (NoFreeBlocks, NeverFits):
            assert expected is None
            assert not self.manager.has_sequence(seq_id)
            return
        assert expected is not None
        assert self.manager.range_of(seq_id) == (expected, expected + blocks)
        self.occupied[expected : expected + blocks] = [True] * blocks
        self.seqs[seq_id] = (expected, blocks, prompt)

    @precondition(lambda self: bool(self.seqs))
    @rule(data=st.data())
    def append(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)))
        first, blocks, tokens = self.seqs[seq_id]
        fits = tokens < blocks * BLOCK
        assert self.manager.can_append([seq_id]) == fits
        if fits:
            self.manager.append_token(seq_id, 9)
            self.seqs[seq_id] = (first, blocks, tokens + 1)

    @precondition(lambda self: bool(self.seqs))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)))
        first, blocks, _ = self.seqs.pop(seq_id)
        self.manager.free(seq_id)
        self.occupied[first : first + blocks] = [False] * blocks

    @invariant()
    def matches_model(self) -> None:
        self.manager.check_integrity()
        usage = self.manager.usage()
        assert usage.reserved_slots == sum(b for _, b, _ in self.seqs.values()) * BLOCK
        assert usage.live_slots == sum(t for _, _, t in self.seqs.values())
        assert usage.internal_fragmentation_slots + usage.reservation_waste_slots == (
            usage.reserved_slots - usage.live_slots
        )
        for seq_id, (first, _, tokens) in self.seqs.items():
            assert self.manager.block_table(seq_id) == list(
                range(first, first + -(-tokens // BLOCK))
            )


SLOTS = 3
SLOT_BLOCKS = 10
UNIT = 2
BUDGET = 14


class VirtualMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.manager = VirtualKVManager(
            num_device_blocks=BUDGET,
            block_size=BLOCK,
            max_model_len=MAX_LEN,
            num_slots=SLOTS,
            slot_blocks=SLOT_BLOCKS,
            commit_blocks=UNIT,
        )
        self.tokens: dict[int, int] = {}
        self.next_id = 0

    @staticmethod
    def committed(tokens: int) -> int:
        blocks = -(-tokens // BLOCK)
        return -(-blocks // UNIT) * UNIT

    def total(self) -> int:
        return sum(self.committed(t) for t in self.tokens.values())

    @rule(prompt=st.integers(1, 39))
    def allocate(self, prompt: int) -> None:
        seq_id = self.next_id
        self.next_id += 1
        fits = len(self.tokens) < SLOTS and self.total() + self.committed(prompt) <= BUDGET
        try:
            self.manager.allocate(seq_id, [3] * prompt, CacheKey(SEED))
        except (NoFreeBlocks, NeverFits):
            assert not fits
            return
        assert fits
        self.tokens[seq_id] = prompt

    @precondition(lambda self: bool(self.tokens))
    @rule(data=st.data())
    def append(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        tokens = self.tokens[seq_id]
        growth = self.committed(tokens + 1) - self.committed(tokens)
        fits = tokens < SLOT_BLOCKS * BLOCK and self.total() + growth <= BUDGET
        assert self.manager.can_append([seq_id]) == fits
        if fits:
            self.manager.append_token(seq_id, 4)
            self.tokens[seq_id] = tokens + 1

    @precondition(lambda self: bool(self.tokens))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        tokens = self.tokens.pop(seq_id)
        free_before = self.manager.num_free_device_blocks()
        self.manager.free(seq_id)
        assert self.manager.num_free_device_blocks() == free_before + self.committed(tokens)

    @invariant()
    def matches_model(self) -> None:
        self.manager.check_integrity()
        usage = self.manager.usage()
        assert usage.backed_slots == self.total() * BLOCK <= BUDGET * BLOCK
        assert usage.live_slots == sum(self.tokens.values())
        assert usage.reserved_slots == len(self.tokens) * SLOT_BLOCKS * BLOCK
        firsts = {self.manager.range_of(s)[0] for s in self.tokens}
        assert len(firsts) == len(self.tokens)
        assert all(f % SLOT_BLOCKS == 0 for f in firsts)


TestContiguous = ContiguousMachine.TestCase
TestContiguous.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestVirtual = VirtualMachine.TestCase
TestVirtual.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_range_layouts_publish_no_cached_block_hashes() -> None:
    """Reserved-range layouts seal nothing for reuse: even a fully computed sequence of whole
    blocks publishes no hash for prefix-aware routing (the paged manager would publish two),
    and they have no block events for the cluster-wide index at all."""
    managers = (
        ContiguousKVManager(num_device_blocks=POOL, block_size=BLOCK, max_model_len=MAX_LEN),
        VirtualKVManager(
            num_device_blocks=BUDGET,
            block_size=BLOCK,
            max_model_len=MAX_LEN,
            num_slots=SLOTS,
            slot_blocks=SLOT_BLOCKS,
            commit_blocks=UNIT,
        ),
    )
    for manager in managers:
        manager.allocate(0, list(range(2 * BLOCK + 1)), CacheKey(SEED))
        manager.mark_computed(0, 2 * BLOCK + 1)
        assert list(manager.cached_block_hashes()) == []
        manager.free(0)
        assert list(manager.cached_block_hashes()) == []
        assert block_events_of(manager) is None
