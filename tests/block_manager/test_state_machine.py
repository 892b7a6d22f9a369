"""Hypothesis state machine: the manager against a simple model of what the KV memory must hold.

The reference model keeps, per sequence, its tokens, computed count, identity and tier, and it
simulates physical memory: a dict from slot to the "KV" written there, where the KV of position
``p`` is ``(identity, tokens[: p + 1])`` (attention KV depends on the whole prefix under one cache
identity). An operator-shared prefix (`unsalted_blocks=k`) is modelled by the chain's
signature: blocks before k carry no salt (the same as salt index 0), so the KV's identity is
`ModelSeq.signature(block)`. The machine plays the workers: it writes KV through
`slot_mapping`, applies every copy-on-write and swap pair the manager returns, and after every
rule reads each resident sequence's computed positions back through its block table. Any wrong
prefix hit (other identity, salt or tokens), lost copy, bad swap pair or block handed to two
writers shows up as wrong KV. `check_integrity()` runs after every rule too.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from block_manager import CacheKey, InvalidOperation, KVCacheManager, NeverFits, NoFreeBlocks
from tests.block_manager.helpers import OTHER_SEED, SEED, observe

BLOCK = 4
DEVICE_BLOCKS = 16
CPU_BLOCKS = 8
SEEDS = (SEED, OTHER_SEED)
SALTS: tuple[tuple[str, ...], ...] = ((), ("tenant-a",))
TOO_LONG = 99  # unsalted blocks beyond any prompt's full blocks: must be refused
PREFIXES = ((1, 2, 3, 4, 5, 6, 7, 8), (1, 2, 3, 4, 9, 9, 9, 9), (5, 5, 5, 5, 5, 5, 5, 5))

Identity = tuple[int, int]  # (seed index, salt index)
Signature = tuple[int, int, int]  # (seed index, salt index, unsalted blocks before the salt)
KV = tuple[Signature, tuple[int, ...]]


@dataclass
class ModelSeq:
    tokens: list[int]
    computed: int
    identity: Identity
    swapped: bool = False
    unsalted: int = 0

    def signature(self, block: int) -> Signature:
        """What, besides the tokens, keys the hash chain up to `block`: a block whose chain is
        all unsalted hashes as if the sequence had no salt at all."""
        seed, salt = self.identity
        if salt == 0 or block < self.unsalted:
            return seed, 0, 0
        return seed, salt, self.unsalted

    def kv(self, position: int) -> KV:
        return self.signature(position // BLOCK), tuple(self.tokens[: position + 1])

    def sealed_key(self, block: int) -> tuple[Signature, tuple[int, ...]]:
        return self.signature(block), tuple(self.tokens[: (block + 1) * BLOCK])


class BlockManagerMachine(RuleBasedStateMachine):
    CPU_CACHE = False

    def __init__(self) -> None:
        super().__init__()
        self.manager = KVCacheManager(
            num_device_blocks=DEVICE_BLOCKS,
            num_cpu_blocks=CPU_BLOCKS,
            block_size=BLOCK,
            watermark_blocks=1,
            record_events=True,
            cpu_cache=self.CPU_CACHE,
        )
        self.findable: dict[str, set[bytes]] = {"device": set(), "cpu": set()}
        """What a cluster-wide index holds after applying every `take_events()` in order."""
        self.seqs: dict[int, ModelSeq] = {}
        self.device_kv: dict[int, KV] = {}
        self.cpu_kv: dict[int, KV] = {}
        self.sealed_prefixes: set[tuple[Signature, tuple[int, ...]]] = set()
        self.next_id = 0
        self.worker_tables: dict[int, list[int]] = {}
        """What the workers hold of each table, built only from `take_table_delta`."""

    # ------------------------------------------------------------------ helpers
    def resident(self) -> list[int]:
        return sorted(seq for seq, model in self.seqs.items() if not model.swapped)

    def swapped(self) -> list[int]:
        return sorted(seq for seq, model in self.seqs.items() if model.swapped)

    def snapshot(self) -> object:
        return observe(self.manager, [*self.seqs, self.next_id])

    def max_possible_hit(self, new: ModelSeq) -> int:
        """Hit blocks are bounded by the chain of full blocks ever computed under the same
        signatures."""
        blocks = 0
        while (blocks + 1) * BLOCK <= len(new.tokens) - 1 and (
            new.sealed_key(blocks) in self.sealed_prefixes
        ):
            blocks += 1
        return blocks * BLOCK

    def guaranteed_hit(self, new: ModelSeq) -> int:
        """Sealed blocks of live resident sequences cannot be evicted, so they must be found."""
        best = 0
        limit = (len(new.tokens) - 1) // BLOCK
        for seq_id in self.resident():
            model = self.seqs[seq_id]
            blocks = 0
            while (
                blocks < min(limit, model.computed // BLOCK)
                and model.signature(blocks) == new.signature(blocks)
                and model.tokens[blocks * BLOCK : (blocks + 1) * BLOCK]
                == new.tokens[blocks * BLOCK : (blocks + 1) * BLOCK]
            ):
                blocks += 1
            best = max(best, blocks)
        return best * BLOCK

    # ------------------------------------------------------------------ rules
    @initialize(prefix=st.sampled_from(PREFIXES))
    def start(self, prefix: tuple[int, ...]) -> None:
        """Every run starts with one computed prompt, so every rule has something to act on."""
        self.manager.allocate(0, list(prefix), CacheKey(SEEDS[0], SALTS[0]))
        slots = self.manager.slot_mapping(0, 0, len(prefix))
        self.seqs[0] = ModelSeq(list(prefix), len(prefix), (0, 0))
        for position, slot in enumerate(slots):
            self.device_kv[slot] = self.seqs[0].kv(position)
        self.manager.mark_computed(0, len(prefix))
        for block in range(len(prefix) // BLOCK):
            self.sealed_prefixes.add(self.seqs[0].sealed_key(block))
        self.next_id = 1

    @rule(
        prefix=st.sampled_from(PREFIXES),
        head=st.sampled_from([8, 8, 8, 4, 4, 6, 2, 0]),
        tail=st.lists(st.integers(0, 9), max_size=6),
        identity=st.sampled_from([(0, 0), (0, 0), (0, 0), (1, 0), (0, 1)]),
        repeat=st.sampled_from([1] * 9 + [12]),  # sometimes more than the whole pool
        unsalted=st.sampled_from([0, 0, 0, 0, 1, 2, 3, TOO_LONG]),  # operator-shared prefix
    )
    def allocate(
        self,
        prefix: tuple[int, ...],
        head: int,
        tail: list[int],
        identity: Identity,
        repeat: int,
        unsalted: int,
    ) -> None:
        tokens = (list(prefix[:head]) + tail or [0]) * repeat
        if unsalted != TOO_LONG:
            unsalted = min(unsalted, len(tokens) // BLOCK)
        seq_id, (seed_index, salt_index) = self.next_id, identity
        key = CacheKey(SEEDS[seed_index], SALTS[salt_index], unsalted)
        if unsalted > len(tokens) // BLOCK:
            before = self.snapshot()
            try:
                self.manager.allocate(seq_id, tokens, key)
            except InvalidOperation:
                event("allocate: unsalted blocks beyond the prompt refused")
                assert self.snapshot() == before
                return
            raise AssertionError("unsalted blocks beyond the prompt's full blocks must be refused")
        expected_ok = self.manager.can_allocate(tokens, key)
        before = self.snapshot()
        try:
            cached = self.manager.allocate(seq_id, tokens, key)
        except NeverFits:
            event("allocate: never fits")
            assert -(-len(tokens) // BLOCK) > DEVICE_BLOCKS
            assert not expected_ok
            assert self.snapshot() == before
            return
        except NoFreeBlocks:
            event("allocate: no free blocks")
            assert not expected_ok
            assert self.snapshot() == before
            return
        assert expected_ok
        self._run_tier_copies()
        self.manager.complete_transfers()
        event(f"allocate: hit {cached // BLOCK} blocks")
        if salt_index and unsalted and cached:
            event("allocate: a salted sequence hit through an unsalted prefix")
        self.next_id += 1
        assert cached % BLOCK == 0
        model = ModelSeq(tokens, cached, identity, unsalted=unsalted)
        assert cached <= self.max_possible_hit(model)
        assert cached >= self.guaranteed_hit(model)
        self.seqs[seq_id] = model
        slots = self.manager.slot_mapping(seq_id, 0, cached)
        for position, slot in enumerate(slots):
            assert self.device_kv.get(slot) == model.kv(position), "prefix hit with wrong KV"

    @precondition(lambda self: any(m.computed < len(m.tokens) for m in self.seqs.values()))
    @rule(data=st.data(), chunk=st.integers(1, 9))
    def compute(self, data: st.DataObject, chunk: int) -> None:
        """The workers compute a chunk: write KV to the planned slots, then mark it computed."""
        candidates = [
            s for s in self.resident() if self.seqs[s].computed < len(self.seqs[s].tokens)
        ]
        if not candidates:
            return
        seq_id = data.draw(st.sampled_from(candidates))
        model = self.seqs[seq_id]
        end = min(len(model.tokens), model.computed + chunk)
        table_before = self.manager.block_table(seq_id)
        slots = self.manager.slot_mapping(seq_id, model.computed, end)
        for position, slot in zip(range(model.computed, end), slots, strict=True):
            self.device_kv[slot] = model.kv(position)
        self.manager.mark_computed(seq_id, end)
        if self.manager.block_table(seq_id) != table_before:
            event("compute: sealed block deduplicated")
        model.computed = end
        for block in range(end // BLOCK):
            self.sealed_prefixes.add(model.sealed_key(block))

    @precondition(lambda self: bool(self.resident()))
    @rule(data=st.data(), token=st.integers(0, 9))
    def append(self, data: st.DataObject, token: int) -> None:
        seq_id = data.draw(st.sampled_from(self.resident()))
        model = self.seqs[seq_id]
        expected_ok = self.manager.can_append([seq_id])
        before = self.snapshot()
        old_table = self.manager.block_table(seq_id)
        try:
            copy = self.manager.append_token(seq_id, token)
        except NoFreeBlocks:
            assert not expected_ok
            assert self.snapshot() == before
            return
        assert expected_ok
        self._run_tier_copies()
        table = self.manager.block_table(seq_id)
        if copy is not None:
            event("append: copy-on-write")
            assert copy.src == old_table[-1] and table == [*old_table[:-1], copy.dst]
            assert copy.num_tokens == len(model.tokens) % BLOCK
            for offset in range(copy.num_tokens):
                source = self.device_kv.get(copy.src * BLOCK + offset)
                assert source is not None
                self.device_kv[copy.dst * BLOCK + offset] = source
        else:
            assert table[: len(old_table)] == old_table
        self.manager.complete_transfers()
        model.tokens.append(token)

    @precondition(lambda self: bool(self.resident()))
    @rule(data=st.data())
    def truncate(self, data: st.DataObject) -> None:
        """A speculative step: the workers write KV for every uncomputed token (drafts), then the
        rejected ones are dropped (`truncate`) and the accepted ones marked computed. Dropped
        blocks must leave the table and return to the pool; nothing computed may move."""
        seq_id = data.draw(st.sampled_from(self.resident()))
        model = self.seqs[seq_id]
        least = max(model.computed, 1, model.unsalted * BLOCK)
        keep = data.draw(st.integers(least - 1, len(model.tokens)))
        before = self.snapshot()
        if keep < least:
            with pytest.raises(InvalidOperation):
                self.manager.truncate(seq_id, keep)
            assert self.snapshot() == before
            return
        table = self.manager.block_table(seq_id)
        slots = self.manager.slot_mapping(seq_id, model.computed, len(model.tokens))
        for position, slot in zip(range(model.computed, len(model.tokens)), slots, strict=True):
            self.device_kv[slot] = model.kv(position)  # what the drafts' rows wrote
        free_before = self.manager.num_free_device_blocks()
        self.manager.truncate(seq_id, keep)
        kept_blocks = -(-keep // BLOCK)
        if keep < len(model.tokens):
            event("truncate: dropped tokens")
        if kept_blocks < len(table):
            event("truncate: released blocks")
        assert self.manager.block_table(seq_id) == table[:kept_blocks]
        assert self.manager.num_free_device_blocks() == free_before + len(table) - kept_blocks
        del model.tokens[keep:]
        self.manager.mark_computed(seq_id, keep)
        model.computed = keep
        for block in range(keep // BLOCK):
            self.sealed_prefixes.add(model.sealed_key(block))

    @precondition(lambda self: bool(self.resident()))
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent_id = data.draw(st.sampled_from(self.resident()))
        parent = self.seqs[parent_id]
        child_id = self.next_id
        if parent.computed < len(parent.tokens):
            before = self.snapshot()
            try:
                self.manager.fork(parent_id, child_id)
            except InvalidOperation:
                assert self.snapshot() == before
                return
            raise AssertionError("fork with uncomputed tokens must be rejected")
        self.manager.fork(parent_id, child_id)
        self.next_id += 1
        self.seqs[child_id] = ModelSeq(
            list(parent.tokens), parent.computed, parent.identity, unsalted=parent.unsalted
        )
        assert self.manager.block_table(child_id) == self.manager.block_table(parent_id)

    @precondition(lambda self: bool(self.seqs))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)))
        self.manager.free(seq_id)
        del self.seqs[seq_id]
        self.worker_tables.pop(seq_id, None)  # the workers release a freed sequence
        assert not self.manager.has_sequence(seq_id)

    @precondition(lambda self: bool(self.resident()))
    @rule(data=st.data())
    def swap_out(self, data: st.DataObject) -> None:
        group = data.draw(
            st.lists(st.sampled_from(self.resident()), min_size=1, max_size=3, unique=True)
        )
        expected_ok = self.manager.can_swap_out(group)
        before = self.snapshot()
        try:
            pairs = self.manager.swap_out(group)
        except NoFreeBlocks as failure:
            event("swap out: cpu full")
            assert failure.tier == "cpu"
            assert not expected_ok
            assert self.snapshot() == before
            return
        assert expected_ok
        assert len({device for device, _ in pairs}) == len({cpu for _, cpu in pairs}) == len(pairs)
        for device, cpu in pairs:
            for offset in range(BLOCK):
                self._copy(
                    self.device_kv, device * BLOCK + offset, self.cpu_kv, cpu * BLOCK + offset
                )
        for seq_id in group:
            self.seqs[seq_id].swapped = True
            self.worker_tables.pop(seq_id, None)  # the workers release a swapped-out sequence

    @precondition(lambda self: bool(self.swapped()))
    @rule(data=st.data())
    def swap_in(self, data: st.DataObject) -> None:
        group = data.draw(
            st.lists(st.sampled_from(self.swapped()), min_size=1, max_size=3, unique=True)
        )
        expected_ok = self.manager.can_swap_in(group)
        before = self.snapshot()
        try:
            pairs = self.manager.swap_in(group)
        except NoFreeBlocks as failure:
            event("swap in: device full")
            assert failure.tier == "device"
            assert not expected_ok
            assert self.snapshot() == before
            return
        assert expected_ok
        self._run_tier_copies()
        for cpu, device in pairs:
            for offset in range(BLOCK):
                self._copy(
                    self.cpu_kv, cpu * BLOCK + offset, self.device_kv, device * BLOCK + offset
                )
        self.manager.complete_transfers()
        for seq_id in group:
            self.seqs[seq_id].swapped = False

    @precondition(lambda self: bool(self.resident()))
    @rule(data=st.data())
    def sync_tables(self, data: st.DataObject) -> None:
        """The workers apply each scheduled sequence's delta to their copy of its table: the
        result is always the manager's table, and the delta never reaches past their copy."""
        group = data.draw(st.lists(st.sampled_from(self.resident()), min_size=1, unique=True))
        for seq_id in group:
            mirror = self.worker_tables.setdefault(seq_id, [])
            start, blocks = self.manager.take_table_delta(seq_id)
            assert 0 <= start <= len(mirror)
            if start < len(mirror):
                event("table delta: an entry below the workers' end was replaced")
            del mirror[start:]
            mirror.extend(blocks)
            assert mirror == self.manager.block_table(seq_id)
            assert self.manager.take_table_delta(seq_id) == (len(mirror), [])

    def _run_tier_copies(self) -> None:
        """Play the workers' first moves of a step: demotions (device -> CPU) before anything
        else, then promotions (CPU -> device); the rule then applies its own pairs and calls
        `complete_transfers` (a step's copies are done). Nothing to do with the tier off."""
        transfers = self.manager.take_transfers()
        for device, cpu in transfers.demote:
            event("tier: demoted a block")
            for offset in range(BLOCK):
                self._copy(
                    self.device_kv, device * BLOCK + offset, self.cpu_kv, cpu * BLOCK + offset
                )
        for cpu, device in transfers.promote:
            event("tier: promoted a block")
            for offset in range(BLOCK):
                self._copy(
                    self.cpu_kv, cpu * BLOCK + offset, self.device_kv, device * BLOCK + offset
                )

    @staticmethod
    def _copy(source: dict[int, KV], src: int, target: dict[int, KV], dst: int) -> None:
        if src in source:
            target[dst] = source[src]
        else:
            target.pop(dst, None)

    # ------------------------------------------------------------------ invariants
    @invariant()
    def integrity(self) -> None:
        self.manager.check_integrity()

    @invariant()
    def events_replay_to_the_findable_set(self) -> None:
        for stored, digest, tier in self.manager.take_events():
            held = self.findable[tier]
            assert (digest in held) != stored, (stored, tier)  # no double store or removal
            (held.add if stored else held.discard)(digest)
        scanned = self.manager.cached_hashes_by_tier()
        assert {tier: set(hashes) for tier, hashes in scanned.items()} == self.findable

    @invariant()
    def matches_model(self) -> None:
        manager = self.manager
        used_slots: set[int] = set()
        used_blocks: set[int] = set()
        for seq_id, model in self.seqs.items():
            assert manager.num_tokens(seq_id) == len(model.tokens)
            assert manager.num_computed_tokens(seq_id) == model.computed
            assert manager.is_swapped(seq_id) == model.swapped
            assert manager.token_ids(seq_id) == model.tokens
            if model.swapped:
                continue
            table = manager.block_table(seq_id)
            assert len(table) == -(-len(model.tokens) // BLOCK)
            used_blocks.update(table)
            used_slots.update(manager.slot_mapping(seq_id, 0, len(model.tokens)))
            for position, slot in enumerate(manager.slot_mapping(seq_id, 0, model.computed)):
                assert self.device_kv.get(slot) == model.kv(position), (
                    f"sequence {seq_id} reads wrong KV at position {position}"
                )
        pressure = manager.pressure()
        assert pressure.device.used + pressure.device.available == DEVICE_BLOCKS
        assert pressure.device.available == manager.num_free_device_blocks()
        assert 0.0 <= pressure.kv_utilization <= 1.0
        if not self.swapped():
            assert pressure.device.used == len(used_blocks)
            assert pressure.tokens_held == len(used_slots)
            assert pressure.token_slots_allocated == len(used_blocks) * BLOCK
            assert pressure.cpu.used == 0


BlockManagerMachine.TestCase.settings = settings(
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestBlockManagerStateMachine = BlockManagerMachine.TestCase
