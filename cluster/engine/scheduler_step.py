"""What one scheduling step produced: the plan for the workers and, beside it, what the
engine needs to apply its result (each sequence's share, the requests it rejected, preempted
or swapped, whether the queues are stuck); `sequence_work` builds a sequence's share of the plan.

Invariant: every request named here is one the scheduler holds; `requests()` is exactly the set
whose state depends on the plan running, so a refused plan is isolated to them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from block_manager import KVManager
from cluster.engine.request import Branch, Request
from workers.plan import SequenceWork, StepPlan


@dataclass
class ScheduledWork:
    """One sequence's share of a step, with the request it belongs to."""

    request: Request
    branch: Branch
    start: int
    num_tokens: int
    num_samples: int
    drafts: Sequence[int] = ()
    """Speculative tokens after the pending one (`num_tokens == 1 + len(drafts)`), verified by
    the step's rows; the block manager holds them until `on_step_done` keeps the accepted."""


@dataclass
class SchedulerStep:
    plan: StepPlan
    works: list[ScheduledWork]
    rejected: list[Request] = field(default_factory=list)
    preempted: bool = False
    """Something was preempted, so swapped and waiting requests were not considered."""
    swapped: list[Request] = field(default_factory=list)
    """Requests whose blocks this plan swaps out or in (their KV moves only if the plan runs)."""
    stalled: bool = False
    """Nothing runs, nothing was preempted, nothing is running and no release is pending (a
    request sent back waits for its release to run), yet a request waits or is swapped: the
    head of the queues cannot fit even in an empty pool (see `unstick_head`)."""

    def requests(self) -> list[Request]:
        """Every request whose state depends on this plan running: its work and its swaps."""
        seen: dict[str, Request] = {}
        for request in [w.request for w in self.works] + self.swapped:
            seen.setdefault(request.request_id, request)
        return list(seen.values())

    @property
    def num_tokens(self) -> int:
        return sum(w.num_tokens for w in self.works)

    @property
    def is_empty(self) -> bool:
        """Nothing for the workers to do: no work, no swaps or copies and no releases (a plan
        that only releases sequences must still reach the workers, or their registries, and
        their pools' memory, keep the state of requests that ended)."""
        return not (self.runs_anything or self.plan.released)

    @property
    def runs_anything(self) -> bool:
        """The plan computes, swaps or copies something (releases alone do not count)."""
        plan = self.plan
        return bool(
            plan.sequences
            or plan.swap_out
            or plan.swap_in
            or plan.copy_pairs
            or plan.demote
            or plan.promote
        )


@dataclass
class PreemptionCounts:
    recompute: int = 0
    swap: int = 0


def sequence_work(
    bm: KVManager,
    request: Request,
    branch: Branch,
    token_ids: list[int],
    start: int,
    num_samples: int,
    num_drafts: int,
    bitmask: object,
    placeholder: bool,
    prompt_targets: list[int] | None = None,
) -> SequenceWork:
    """The branch's `SequenceWork` for tokens from `start` (the table delta taken now; the
    settings and, when its penalties need them, the tokens before `start`, the first time the
    worker sees the branch; `prompt_targets` the prompt tokens whose logprobs the chunk gives).
    A placeholder (async scheduling's one token for the token in flight) has its output
    index one past the branch's. The dataclass is built by position: keyword arguments cost
    more than the rest of the construction, once per sequence per step."""
    table_start, table_blocks = bm.take_table_delta(branch.seq_id)
    settings = None if branch.worker_knows else request.settings
    history = branch.token_ids[:start] if settings is not None and settings.needs_history else None
    work = SequenceWork(
        branch.seq_id,
        token_ids,
        start,  # start_pos
        table_start,
        table_blocks,
        num_samples,
        branch.index,  # branch_index
        len(branch.output_token_ids) + placeholder,  # output_index
        settings,  # sampling
        -1,  # lora_slot (the engine's adapters place it)
        num_drafts,  # num_draft_tokens
        bitmask,  # token_bitmask
        placeholder,
        history,  # the tokens before `start`, when the penalties read them
        prompt_targets,
    )
    branch.worker_knows = True
    return work
