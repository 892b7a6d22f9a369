"""A Hypothesis state machine of two replicas' block managers, the KV directory that follows
their events, and pulls between them (pins on both ends), with faults in flight.

Invariants checked after every step: both managers' integrity (lease pins counted), a pinned
export block never changes while pinned, the directory's answer for every prompt equals the
leading blocks each manager really holds, and every pull that ends leaves no pin behind.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from block_manager import CacheKey, KVCacheManager, NoFreeBlocks
from block_manager.prompt_blocks import prompt_block_keys
from block_manager.transfer_leases import TransferLease
from cluster.serving.directory_index import DirectoryIndex, PoolView

BLOCK = 4
SEED = bytes(range(32))
PREFIXES = [[100 + p] * (BLOCK * 3) for p in range(3)]
PROMPTS = [prefix + [7 + t] * (BLOCK + 1) for prefix in PREFIXES for t in range(2)]
REPLICAS = ("a", "b")


@dataclass
class Pull:
    holder: str
    receiver: str
    keys: list[bytes]
    export: TransferLease
    landing: TransferLease


class DirectoryWithTransfers(RuleBasedStateMachine):
    @initialize(cpu=st.booleans())
    def build(self, cpu: bool) -> None:
        self.managers = {
            name: KVCacheManager(
                num_device_blocks=14,
                num_cpu_blocks=8 if cpu else 0,
                block_size=BLOCK,
                record_events=True,
                cpu_cache=cpu,
            )
            for name in REPLICAS
        }
        self.index = DirectoryIndex(max_entries=10_000)
        self.seq = {name: 0 for name in REPLICAS}
        for name, manager in self.managers.items():
            self.index.snapshot(name, 0, manager.cached_hashes_by_tier(), PoolView())
        self.pulls: list[Pull] = []
        self.next_seq = 0
        self.key = CacheKey(SEED)

    def _publish(self) -> None:
        for name, manager in self.managers.items():
            self.seq[name] += 1
            assert self.index.apply(name, self.seq[name], manager.take_events(), PoolView())

    def _held(self, name: str, prompt: list[int]) -> int:
        """Leading blocks of `prompt` the manager holds on either tier (its own lookup)."""
        return self.managers[name].cached_prefix_tokens(prompt, self.key) // BLOCK

    @rule(replica=st.sampled_from(REPLICAS), prompt=st.sampled_from(PROMPTS))
    def compute(self, replica: str, prompt: list[int]) -> None:
        manager = self.managers[replica]
        seq = self.next_seq
        self.next_seq += 1
        try:
            manager.allocate(seq, prompt, self.key)
        except NoFreeBlocks:
            return
        manager.mark_computed(seq, len(prompt))
        manager.take_transfers()  # the step that ran the prompt ran its tier copies too
        manager.complete_transfers()
        manager.free(seq)
        self._publish()

    @rule(
        holder=st.sampled_from(REPLICAS),
        prompt=st.sampled_from(PROMPTS),
        use_directory=st.booleans(),
    )
    def start_pull(self, holder: str, prompt: list[int], use_directory: bool) -> None:
        receiver = next(r for r in REPLICAS if r != holder)
        keys, hashes = prompt_block_keys(prompt, self.key, BLOCK)
        local = self._held(receiver, prompt)
        if use_directory:  # ask the directory, as the receiver does
            held = self.index.query(hashes).get(holder)
            if held is None or held.blocks <= local:
                return
        export = self.managers[holder].transfer_leases.pin_export(keys[local:])
        try:
            landing = self.managers[receiver].transfer_leases.reserve_import(len(export.blocks))
        except NoFreeBlocks:
            self.managers[holder].transfer_leases.release(export.lease_id)
            return
        self.pulls.append(Pull(holder, receiver, keys[local:], export, landing))
        self._publish()  # landing blocks may have evicted cached ones

    @precondition(lambda self: self.pulls)
    @rule(data=st.data(), fault=st.sampled_from(["none", "stale", "abort"]))
    def finish_pull(self, data: st.DataObject, fault: str) -> None:
        pull = self.pulls.pop(data.draw(st.integers(0, len(self.pulls) - 1)))
        holder, receiver = self.managers[pull.holder], self.managers[pull.receiver]
        assert holder.transfer_leases.changed(pull.export.lease_id) == []
        count = len(pull.export.blocks)
        if fault == "stale" and count:
            count = data.draw(st.integers(0, count - 1))  # stop at the block that changed
        if fault == "abort":  # the holder died or the request went away: nothing lands
            count = 0
        if count:
            receiver.transfer_leases.seal_import(pull.landing.lease_id, pull.keys[:count])
        holder.transfer_leases.release(pull.export.lease_id)
        receiver.transfer_leases.release(pull.landing.lease_id)
        cached = set(receiver.cached_block_hashes())
        for pinned in pull.export.blocks[:count]:
            assert pinned.block_hash in cached  # sealed under the same exact key
        self._publish()

    @invariant()
    def managers_consistent(self) -> None:
        for manager in self.managers.values():
            manager.check_integrity()
        for pull in self.pulls:
            assert self.managers[pull.holder].transfer_leases.changed(pull.export.lease_id) == []

    @invariant()
    def no_demotion_reads_a_landing_block(self) -> None:
        """A landing block's bytes may arrive any time: no pending tier copy may read it."""
        for pull in self.pulls:
            tier = self.managers[pull.receiver]._tier
            if tier is None:
                continue
            landing = {pinned.block for pinned in pull.landing.blocks}
            assert not landing & {device for device, _ in tier.transfers.demote}

    @invariant()
    def directory_matches_the_managers(self) -> None:
        for prompt in PROMPTS:
            _, hashes = prompt_block_keys(prompt, self.key, BLOCK)
            answer = self.index.query(hashes)
            for name, manager in self.managers.items():
                held = set(manager.cached_block_hashes()) | set(
                    manager.cached_hashes_by_tier().get("cpu", [])
                )
                leading = 0
                for digest in hashes:
                    if digest not in held:
                        break
                    leading += 1
                got = answer[name].blocks if name in answer else 0
                assert got == leading, (name, got, leading)

    def teardown(self) -> None:
        for pull in self.pulls:  # whatever was in flight ends
            self.managers[pull.holder].transfer_leases.release(pull.export.lease_id)
            self.managers[pull.receiver].transfer_leases.release(pull.landing.lease_id)
        for manager in getattr(self, "managers", {}).values():
            assert manager.transfer_leases.active() == []
            assert manager.transfer_leases.pinned_refs() == ({}, {})
            manager.check_integrity()


DirectoryWithTransfers.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None
)
TestDirectoryWithTransfers = DirectoryWithTransfers.TestCase
