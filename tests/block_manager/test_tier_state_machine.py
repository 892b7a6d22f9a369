"""The state machine of `test_state_machine` over two cache tiers (the CPU pool as a cache tier).

Every rule of `BlockManagerMachine` runs against a manager with ``cpu_cache=True``: allocations
evict cached device blocks (demoted to the CPU tier first), prefix hits find blocks in either tier
(CPU hits promoted), swaps, forks and frees interleave with them. The machine plays the workers'
step order (demotions, then swaps and promotions, then the forward pass), checks after every rule
that each resident sequence reads exactly the KV last written for each of its tokens, that
`check_integrity()` holds and that the event stream replays to the findable set of both tiers.
Two rules only this machine has: several allocations planned in one step before any copy runs
(in-flight pins keep them from overwriting each other's sources), and a CPU block changed behind
the tier's back (its generation moves), whose hit must then be refused and never served.
"""

from __future__ import annotations

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from block_manager import CacheKey, NoFreeBlocks
from tests.block_manager.test_state_machine import (
    BLOCK,
    PREFIXES,
    SALTS,
    SEEDS,
    BlockManagerMachine,
    ModelSeq,
)


class TierMachine(BlockManagerMachine):
    CPU_CACHE = True

    @rule(
        prompts=st.lists(
            st.tuples(
                st.sampled_from(PREFIXES),
                st.sampled_from([8, 8, 4, 6]),
                st.lists(st.integers(0, 9), max_size=5),
                st.sampled_from([1, 1, 2, 3]),
            ),
            min_size=2,
            max_size=3,
        )
    )
    def allocate_in_one_step(
        self, prompts: list[tuple[tuple[int, ...], int, list[int], int]]
    ) -> None:
        """Several admissions plan their copies before the workers run any of them."""
        admitted: list[tuple[int, ModelSeq, int]] = []
        for prefix, head, tail, repeat in prompts:
            tokens = (list(prefix[:head]) + tail or [0]) * repeat
            seq_id = self.next_id
            try:
                cached = self.manager.allocate(seq_id, tokens, CacheKey(SEEDS[0], SALTS[0]))
            except NoFreeBlocks:
                continue
            self.next_id += 1
            model = ModelSeq(tokens, cached, (0, 0))
            assert cached <= self.max_possible_hit(model)
            self.seqs[seq_id] = model
            admitted.append((seq_id, model, cached))
        self._run_tier_copies()
        self.manager.complete_transfers()
        event(f"one step: {len(admitted)} admissions")
        for seq_id, model, cached in admitted:
            slots = self.manager.slot_mapping(seq_id, 0, cached)
            for position, slot in enumerate(slots):
                assert self.device_kv.get(slot) == model.kv(position), "tier hit with wrong KV"

    @precondition(lambda self: bool(self.manager._cpu.cached))
    @rule(data=st.data())
    def change_cpu_block_behind_the_tier(self, data: st.DataObject) -> None:
        """A CPU cached block is overwritten by something the tier did not plan: its generation
        moves and its bytes change, so a later hit on it must be refused, never served."""
        cpu = self.manager._cpu
        block = data.draw(st.sampled_from(sorted(cpu.cached.values())))
        cpu.generations[block] += 1
        for offset in range(BLOCK):
            self.cpu_kv[block * BLOCK + offset] = ((9, 9, 9), (-1,))
        event("tier: a cpu block changed behind the tier")


TierMachine.TestCase.settings = BlockManagerMachine.TestCase.settings
TestTierStateMachine = TierMachine.TestCase


def test_a_stale_cpu_copy_is_refused_and_counted() -> None:
    """A demoted block whose generation moved since its copy is a miss, dropped and counted."""
    from block_manager import KVCacheManager

    manager = KVCacheManager(
        num_device_blocks=4, num_cpu_blocks=4, block_size=BLOCK, cpu_cache=True
    )
    key = CacheKey(SEEDS[0], SALTS[0])
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    manager.allocate(0, prompt, key)
    manager.mark_computed(0, len(prompt))
    manager.free(0)
    manager.allocate(1, [7] * 16, key)  # needs every device block: the prefix is demoted
    demoted = manager.take_transfers().demote
    assert len(demoted) == 2
    manager.complete_transfers()
    manager.free(1)
    assert manager.cached_prefix_tokens(prompt, key) == 8  # findable in the CPU tier
    # `free` releases a table back to front, so the chain's first block is demoted last
    manager._cpu.generations[demoted[-1][1]] += 1  # the first block changed since its copy
    assert manager.allocate(2, prompt, key) == 0
    assert manager.take_transfers().promote == []
    assert manager.tier_counters().refused_swap_ins == 1
    manager.complete_transfers()
    manager.check_integrity()
