"""Hypothesis state machine: the hybrid manager against a model of what each group's KV holds.

The machine plays the workers of a model with three KV groups (full attention, a sliding
window of 8 and one of 5, blocks of 4). It keeps a simulated KV store per tier: slot -> the
KV written there, where group g's KV of position p is `(g, tokens[: p + 1])` (one cache
identity). Computing a chunk writes every group's KV through the group's table and, before
marking it computed, reads for every query position what that group's attention reads
(the whole prefix for a full group, the last `window` positions for a sliding one) and
checks each slot holds exactly that KV: a wrong prefix hit, a lost copy-on-write or swap, a
block handed to two writers or dropped while inside a window all show up as wrong or missing
KV. The tables are also rebuilt from `take_table_delta` alone (the workers' view) and
compared, the oracle's block count per group is compared with the manager's tables, and
`check_integrity()` runs after every rule.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from block_manager import CacheKey, NeverFits, NoFreeBlocks
from block_manager.hybrid import HybridKVManager
from tests.block_manager.helpers import SEED

BLOCK = 4
WINDOWS = (None, 8, 5)
DEVICE_BLOCKS = 40
CPU_BLOCKS = 24
KEY = CacheKey(SEED)
PREFIXES = ((1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4), (1, 2, 3, 4, 9, 9, 9, 9), (5,) * 12)

KV = tuple[int, tuple[int, ...]]


@dataclass
class ModelSeq:
    tokens: list[int]
    computed: int
    swapped: bool = False


def reads(window: int | None, position: int) -> range:
    """The key positions a query at `position` reads under `window`."""
    return range(0 if window is None else max(0, position - window + 1), position + 1)


class HybridMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.manager = HybridKVManager(
            windows=WINDOWS,
            num_device_blocks=DEVICE_BLOCKS,
            num_cpu_blocks=CPU_BLOCKS,
            block_size=BLOCK,
            watermark_blocks=1,
        )
        self.seqs: dict[int, ModelSeq] = {}
        self.kv: dict[str, dict[int, KV]] = {"device": {}, "cpu": {}}
        self.worker_tables: dict[int, list[int]] = {}
        self.next_id = 0

    # ------------------------------------------------------------------ the workers' side
    def _sync(self, seq_id: int) -> list[list[int]]:
        """Apply the table delta as the workers do; return the de-interleaved group tables."""
        start, blocks = self.manager.take_table_delta(seq_id)
        table = self.worker_tables.setdefault(seq_id, [])
        assert start <= len(table)
        del table[start:]
        table.extend(blocks)
        assert table == self.manager.block_table(seq_id)
        return [table[g :: len(WINDOWS)] for g in range(len(WINDOWS))]

    def _copy(self, pairs: list[tuple[int, int]], source: str, target: str) -> None:
        for src, dst in pairs:
            for slot in range(BLOCK):
                value = self.kv[source].get(src * BLOCK + slot)
                if value is None:
                    self.kv[target].pop(dst * BLOCK + slot, None)
                else:
                    self.kv[target][dst * BLOCK + slot] = value

    def _compute(self, seq_id: int, end: int) -> None:
        seq = self.seqs[seq_id]
        tables = self._sync(seq_id)
        store = self.kv["device"]
        null = self.manager.null_block
        for position in range(seq.computed, end):
            for group in range(len(WINDOWS)):
                block = tables[group][position // BLOCK]
                assert block != null, "a write goes to the null block"
                store[block * BLOCK + position % BLOCK] = (group, tuple(seq.tokens[: position + 1]))
        for position in range(seq.computed, end):
            for group, window in enumerate(WINDOWS):
                for key in reads(window, position):
                    block = tables[group][key // BLOCK]
                    assert block != null, f"group {group} reads null at {key} for {position}"
                    want = (group, tuple(seq.tokens[: key + 1]))
                    assert store.get(block * BLOCK + key % BLOCK) == want
        self.manager.mark_computed(seq_id, end)
        seq.computed = end

    def _resident(self) -> list[int]:
        return [s for s, seq in self.seqs.items() if not seq.swapped]

    # ------------------------------------------------------------------ rules
    @rule(
        prefix=st.sampled_from(PREFIXES),
        tail=st.lists(st.integers(1, 3), max_size=6),
        cut=st.integers(1, 12),
    )
    def allocate(self, prefix: tuple[int, ...], tail: list[int], cut: int) -> None:
        tokens = list(prefix[:cut]) + tail
        needed = self.manager.blocks_needed_to_allocate(tokens, KEY)
        seq_id = self.next_id
        self.next_id += 1
        free = self.manager.num_free_device_blocks()
        try:
            cached = self.manager.allocate(seq_id, tokens, KEY)
        except NoFreeBlocks:
            assert needed > free - self.manager.watermark_blocks
            return
        except NeverFits:
            return
        assert free - self.manager.num_free_device_blocks() == needed
        assert cached % BLOCK == 0 and cached < len(tokens)
        self.seqs[seq_id] = ModelSeq(tokens, cached)
        self.worker_tables[seq_id] = []
        if cached:  # the hit's KV must already be there for every read the next query makes
            self._compute(seq_id, cached)

    @precondition(lambda self: any(s.computed < len(s.tokens) for s in self.seqs.values()))
    @rule(data=st.data())
    def compute_chunk(self, data: st.DataObject) -> None:
        candidates = [
            s for s in self._resident() if self.seqs[s].computed < len(self.seqs[s].tokens)
        ]
        if not candidates:
            return
        seq_id = data.draw(st.sampled_from(candidates))
        seq = self.seqs[seq_id]
        end = data.draw(st.integers(seq.computed + 1, len(seq.tokens)))
        self._compute(seq_id, end)

    @precondition(lambda self: bool(self.seqs))
    @rule(data=st.data(), token=st.integers(1, 3))
    def append(self, data: st.DataObject, token: int) -> None:
        done = [s for s in self._resident() if self.seqs[s].computed == len(self.seqs[s].tokens)]
        if not done:
            return
        seq_id = data.draw(st.sampled_from(done))
        if not self.manager.can_append([seq_id]):
            with pytest.raises(NoFreeBlocks):  # the count agrees with what appending takes
                self.manager.append_token(seq_id, token)
            return
        free = self.manager.num_free_device_blocks()
        copy = self.manager.append_token(seq_id, token)
        taken = free - self.manager.num_free_device_blocks()
        assert taken == (len(WINDOWS) if len(self.seqs[seq_id].tokens) % BLOCK == 0 else 0) + (
            0 if copy is None else len(copy.pairs())
        )
        if copy is not None:
            self._copy(copy.pairs(), "device", "device")
        self.seqs[seq_id].tokens.append(token)

    @precondition(lambda self: bool(self.seqs))
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        done = [s for s in self._resident() if self.seqs[s].computed == len(self.seqs[s].tokens)]
        if not done:
            return
        parent = data.draw(st.sampled_from(done))
        child = self.next_id
        self.next_id += 1
        self.manager.fork(parent, child)
        self.seqs[child] = ModelSeq(list(self.seqs[parent].tokens), self.seqs[parent].computed)
        self.worker_tables[child] = []

    @precondition(lambda self: bool(self.seqs))
    @rule(data=st.data())
    def truncate(self, data: st.DataObject) -> None:
        open_ = [s for s in self._resident() if self.seqs[s].computed < len(self.seqs[s].tokens)]
        if not open_:
            return
        seq_id = data.draw(st.sampled_from(open_))
        seq = self.seqs[seq_id]
        keep = data.draw(st.integers(max(seq.computed, 1), len(seq.tokens)))
        self.manager.truncate(seq_id, keep)
        del seq.tokens[keep:]

    @precondition(lambda self: bool(self.seqs))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)))
        self.manager.free(seq_id)
        del self.seqs[seq_id]
        self.worker_tables.pop(seq_id, None)

    @precondition(lambda self: bool(self.seqs))
    @rule(data=st.data())
    def swap_out(self, data: st.DataObject) -> None:
        resident = self._resident()
        if not resident:
            return
        seq_id = data.draw(st.sampled_from(resident))
        if not self.manager.can_swap_out([seq_id]):
            return
        self._copy(self.manager.swap_out([seq_id]), "device", "cpu")
        self.seqs[seq_id].swapped = True
        self.worker_tables[seq_id] = []

    @precondition(lambda self: any(s.swapped for s in self.seqs.values()))
    @rule(data=st.data())
    def swap_in(self, data: st.DataObject) -> None:
        swapped = sorted(s for s, seq in self.seqs.items() if seq.swapped)
        seq_id = data.draw(st.sampled_from(swapped))
        if not self.manager.can_swap_in([seq_id]):
            return
        self._copy(self.manager.swap_in([seq_id]), "cpu", "device")
        self.seqs[seq_id].swapped = False

    # ------------------------------------------------------------------ invariants
    @invariant()
    def integrity(self) -> None:
        self.manager.check_integrity()

    @invariant()
    def windows_hold_their_kv(self) -> None:
        """What every group's next query reads is in place; nothing more is held."""
        null = self.manager.null_block
        for seq_id in self._resident():
            seq = self.seqs[seq_id]
            tables = self._sync(seq_id)
            for group, window in enumerate(WINDOWS):
                table = tables[group]
                assert len(table) == -(-len(seq.tokens) // BLOCK)
                first = reads(window, seq.computed).start // BLOCK
                assert all(block == null for block in table[:first])
                assert null not in table[first:]
                for key in range(reads(window, seq.computed).start, seq.computed):
                    want = (group, tuple(seq.tokens[: key + 1]))
                    block = table[key // BLOCK]
                    assert self.kv["device"].get(block * BLOCK + key % BLOCK) == want


TestHybridStateMachine = HybridMachine.TestCase
TestHybridStateMachine.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
