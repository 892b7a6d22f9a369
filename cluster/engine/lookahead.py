"""Which steps async scheduling may plan ahead: the decodes of a step whose output is unknown.

With `scheduler.async_scheduling`, while step N runs the engine plans step N+1: each sequence
decoding in N gets one placeholder token in N+1 (its slot appended now, at the position N's
sampled token will take), filled on the worker side from N's output (`workers.placeholders`).
That is only done when N+1 would be exactly N's plain decodes again, so that nothing planned
ahead depends on N's tokens beyond their ids:

- nothing is swapped, and nothing waits unless the running requests take every seat
  (`max_num_seqs`): an admission, a swap-in or a preemption falls back to planning after N's
  output, as without the lookahead (a seat N's token frees is filled one step later);
- every running request has one branch, is past its prompt and decodes one token in N, with no
  speculative drafts, no grammar (its bitmask depends on N's token), no adapter (LoRA off) and
  no prefill/decode hand-off;
- N swaps nothing and was not a preempting, rejecting or stalled step;
- one more token for every sequence fits in the device pool now (else the normal schedule
  preempts as it must).

A sequence that N's token ends for certain (`max_tokens`, the model's length) is left out. One
that N's token ends otherwise (EOS, a stop token id, a stop string, an abort meanwhile) has its
planned-ahead token computed and dropped, never reported, and its blocks freed with the rest.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from block_manager import BlockCopy, KVManager
from cluster.engine.request import Request
from cluster.engine.scheduler_step import ScheduledWork, SchedulerStep
from workers.plan import SampledToken

if TYPE_CHECKING:
    from cluster.engine.scheduler import Scheduler


def lookahead_decodes(scheduler: Scheduler, base: SchedulerStep) -> list[Request] | None:
    """The requests step `base`'s successor decodes (each its one branch) when it may be
    planned before `base`'s output is known (see the module doc), in running order; None when
    it may not be (the successor is then planned after `base`'s output, as usual)."""
    if scheduler.swapped or scheduler.speculator is not None or scheduler.max_loras is not None:
        return None
    if scheduler.waiting and not scheduler.seats_taken():
        return None
    plan = base.plan
    if base.preempted or base.swapped or base.rejected or base.stalled:
        return None
    if plan.swap_in or plan.swap_out or plan.promote or plan.forks:
        return None
    works = base.works
    num_works, next_work = len(works), 0
    by_seq_id: dict[int, ScheduledWork] | None = None
    max_model_len = scheduler.max_model_len
    chosen: list[Request] = []
    for request in scheduler.running:
        if len(request.branches) != 1 or not request.forked or request.prefill_only:
            return None
        branch = request.branches[0]
        # base's works mostly follow the running order: walk them, and look up the others
        work = None
        while next_work < num_works:
            candidate = works[next_work]
            next_work += 1
            if candidate.branch is branch:
                work = candidate
                break
        if work is None:
            if by_seq_id is None:
                by_seq_id = {w.branch.seq_id: w for w in works}
            work = by_seq_id.get(branch.seq_id)
        if (
            work is None
            or work.request is not request
            or work.num_tokens != 1
            or work.num_samples != 1
            or work.drafts
            or branch.grammar is not None
            or work.start + 1 != len(branch.token_ids)
        ):
            return None
        if len(branch.output_token_ids) + 1 >= request.max_tokens:
            continue  # base's token is its last
        if max_model_len is not None and len(branch.token_ids) + 1 >= max_model_len:
            continue
        chosen.append(request)
    if not chosen or not scheduler.bm.can_append([r.branches[0].seq_id for r in chosen]):
        return None
    return chosen


class Placeholders:
    """The sequences whose last table slot a step planned ahead appended for a token still
    being sampled, with that slot's position; the block manager holds a stand-in id there
    until `fill` writes the real one in (before any block holding it is sealed: sealing needs
    the token computed, which happens in the step planned ahead, later)."""

    def __init__(self, block_manager: KVManager) -> None:
        self.bm = block_manager
        self._positions: dict[int, int] = {}

    def __bool__(self) -> bool:
        return bool(self._positions)

    def append(self, seq_id: int, position: int) -> BlockCopy | None:
        """Appends the slot at `position` (the sequence's next); the copy-on-write it needs."""
        copy = self.bm.append_token(seq_id, 0)  # the id comes with the step in flight's output
        self._positions[seq_id] = position
        return copy

    def fill(self, seq_id: int, position: int, sampled: SampledToken) -> None:
        """The step in flight sampled `sampled` at `position` for `seq_id`: into its slot, if a
        step planned ahead holds one."""
        held = self._positions.pop(seq_id, None)
        if held is None:
            return
        if held != position:
            raise RuntimeError(
                f"sequence {seq_id}: a placeholder at {held}, but the token came for {position}"
            )
        self.bm.replace_token(seq_id, position, sampled.token_id)

    def drop(self, seq_id: int) -> None:
        """The sequence left the device (its blocks, the slot's included, are freed)."""
        self._positions.pop(seq_id, None)
