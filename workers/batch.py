"""Per-sequence state cached on a rank, and the packed batch a `StepPlan` turns into.

Plans carry deltas only (see `workers.plan`): the rank keeps each sequence's block table and
sampling settings here, and, when its penalties read earlier tokens, every token it was fed by
position (its `history`: truncated to each work's `start_pos` and extended by its tokens, so
speculative drafts a later step rewinds are dropped). Order within one plan: forks, then
releases, then the sequences' table splices and settings, so a sequence released and
re-scheduled in one plan starts afresh. A plan that fails validation leaves the cached state
as it was.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from workers.kv_groups import KVGroupLayout
from workers.model import AttentionMetadata
from workers.plan import PlanRejected, SamplingSettings, SequenceWork, StepPlan
from workers.sampling import PromptRows, SampleRequest


@dataclass
class SequenceState:
    """What a rank remembers about a sequence between steps."""

    block_table: list[int] = field(default_factory=list)
    sampling: SamplingSettings | None = None
    history: list[int] | None = None
    """The tokens at positions `[0, end of its last work)`, kept only when `sampling` needs
    them."""

    def copy(self) -> SequenceState:
        history = None if self.history is None else list(self.history)
        return SequenceState(list(self.block_table), self.sampling, history)


@dataclass
class PackedBatch:
    """The forward pass input of one step, plus which rows to sample and how."""

    token_ids: torch.Tensor
    metadata: AttentionMetadata
    sample_seq_ids: list[int]
    sample_requests: list[SampleRequest]
    lora_slots: torch.Tensor | None = None
    """`[tokens]` int64, each token's LoRA slot (-1: base model); None when no token has one."""
    prompt_rows: PromptRows | None = None
    """The rows whose logits give prompt logprobs (None: no work asks for them)."""


class SequenceRegistry:
    """Sequence id -> `SequenceState`, updated from each plan's deltas."""

    def __init__(self) -> None:
        self.states: dict[int, SequenceState] = {}

    def apply(self, plan: StepPlan) -> dict[int, SequenceState | None]:
        """Apply forks, releases and table splices; returns a snapshot for `restore`.

        On an inconsistent plan raises ValueError with the registry unchanged.
        """
        touched = {child for _, child in plan.forks} | set(plan.released)
        touched |= {work.seq_id for work in plan.sequences}
        snapshot = {seq_id: self._copy(seq_id) for seq_id in touched}
        try:
            self._apply(plan)
        except ValueError:
            self.restore(snapshot)
            raise
        return snapshot

    def restore(self, snapshot: dict[int, SequenceState | None]) -> None:
        """Put back the states `apply` replaced (None: the sequence was not known)."""
        for seq_id, state in snapshot.items():
            if state is None:
                self.states.pop(seq_id, None)
            else:
                self.states[seq_id] = state

    def _copy(self, seq_id: int) -> SequenceState | None:
        state = self.states.get(seq_id)
        return None if state is None else state.copy()

    def _apply(self, plan: StepPlan) -> None:
        for parent, child in plan.forks:
            if parent not in self.states:
                raise PlanRejected(
                    f"step {plan.step_id}: fork of unknown sequence {parent}", (child,)
                )
            self.states[child] = self.states[parent].copy()
        for seq_id in plan.released:
            self.states.pop(seq_id, None)
        for work in plan.sequences:
            state = self.states.setdefault(work.seq_id, SequenceState())
            if work.table_start > len(state.block_table):
                raise PlanRejected(
                    f"step {plan.step_id}: sequence {work.seq_id} splices its block table at "
                    f"{work.table_start} but only {len(state.block_table)} entries are cached",
                    (work.seq_id,),
                )
            del state.block_table[work.table_start :]
            state.block_table.extend(work.table_blocks)
            if work.sampling is not None:
                state.sampling = work.sampling
                state.history = None if work.history is None else list(work.history)
            if state.history is not None:
                if work.start_pos > len(state.history):
                    raise PlanRejected(
                        f"step {plan.step_id}: sequence {work.seq_id} starts at {work.start_pos} "
                        f"but only {len(state.history)} of its tokens are known",
                        (work.seq_id,),
                    )
                del state.history[work.start_pos :]
                state.history.extend(work.token_ids)


def _check_work(
    plan: StepPlan, work: SequenceWork, state: SequenceState, block_size: int, groups: int = 1
) -> None:
    if not work.token_ids:
        raise PlanRejected(
            f"step {plan.step_id}: sequence {work.seq_id} has no tokens", (work.seq_id,)
        )
    if work.prompt_targets and (
        work.num_draft_tokens
        or len(work.prompt_targets) > len(work.token_ids)
        or state.sampling is None
        or state.sampling.prompt_logprobs is None
    ):
        raise PlanRejected(
            f"step {plan.step_id}: sequence {work.seq_id} asks for {len(work.prompt_targets)} "
            f"prompt logprobs over {len(work.token_ids)} tokens without drafts, with settings "
            "that ask for them",
            (work.seq_id,),
        )
    if work.start_pos < 0:
        raise PlanRejected(
            f"step {plan.step_id}: sequence {work.seq_id} has start_pos < 0", (work.seq_id,)
        )
    needed = -(-(work.start_pos + len(work.token_ids)) // block_size) * groups
    if len(state.block_table) < needed:
        raise PlanRejected(
            f"step {plan.step_id}: sequence {work.seq_id} needs {needed} blocks for "
            f"{work.start_pos + len(work.token_ids)} tokens in {groups} KV group(s) but its "
            "block table has "
            f"{len(state.block_table)}",
            (work.seq_id,),
        )
    if work.num_draft_tokens and (
        work.num_samples != 1 or not 0 < work.num_draft_tokens < len(work.token_ids)
    ):
        raise PlanRejected(
            f"step {plan.step_id}: sequence {work.seq_id} has {work.num_draft_tokens} drafts "
            f"among {len(work.token_ids)} tokens and {work.num_samples} samples (drafts follow "
            "one pending token and take one sample each)",
            (work.seq_id,),
        )
    if work.token_bitmask is not None and (
        work.num_samples == 0 or len(work.token_bitmask) != 1 + work.num_draft_tokens
    ):
        raise PlanRejected(
            f"step {plan.step_id}: sequence {work.seq_id} has {len(work.token_bitmask)} token "
            f"bitmask rows for {work.num_samples} samples and {work.num_draft_tokens} drafts "
            "(one row per drawing position)",
            (work.seq_id,),
        )
    if work.num_samples > 0 and state.sampling is None:
        raise PlanRejected(
            f"step {plan.step_id}: sequence {work.seq_id} asks for samples but no sampling "
            "settings were ever sent for it",
            (work.seq_id,),
        )
    if work.num_samples > 0 and state.sampling.needs_history and state.history is None:
        raise PlanRejected(
            f"step {plan.step_id}: sequence {work.seq_id} has penalties but its earlier tokens "
            "were never sent",
            (work.seq_id,),
        )


def _query_spans(work: SequenceWork) -> list[tuple[int, int, int]]:
    """(first position, tokens, output index of its draw) of each query the work is packed as:
    the whole work, or for a speculative one a one-token decode per position, so every draft
    row is computed (and sampled) exactly as that position's plain decode would be."""
    if work.num_draft_tokens == 0:
        return [(work.start_pos, len(work.token_ids), work.output_index)]
    return [(work.start_pos + i, 1, work.output_index + i) for i in range(len(work.token_ids))]


def pack_batch(
    plan: StepPlan,
    registry: SequenceRegistry,
    block_size: int,
    device: torch.device,
    kv_groups: KVGroupLayout | None = None,
) -> PackedBatch:
    """Token ids, positions, slot mapping, block tables and sample rows of `plan.sequences`.

    `kv_groups` with several groups: each cached table interleaves the groups' tables
    (`block_manager.hybrid_state`), and the metadata carries each group's slots and tables.
    """
    groups = 1 if kv_groups is None else kv_groups.num_groups
    token_ids: list[int] = []
    positions: list[int] = []
    group_slots: list[list[int]] = [[] for _ in range(groups)]
    group_batch_tables: list[list[list[int]]] = [[] for _ in range(groups)]
    cu_query_lens = [0]
    context_lens: list[int] = []
    logits_rows: list[int] = []
    sample_seq_ids: list[int] = []
    requests: list[SampleRequest] = []
    prompt_rows: PromptRows | None = None
    lora_slots: list[int] = []
    for work in plan.sequences:
        state = registry.states[work.seq_id]
        _check_work(plan, work, state, block_size, groups)
        table = state.block_table
        seq_tables = [table[g::groups] for g in range(groups)] if groups > 1 else [table]
        if work.prompt_targets:
            prompt_rows = prompt_rows or PromptRows()
            targets = work.prompt_targets
            first = len(token_ids)
            prompt_rows.rows.extend(range(first, first + len(targets)))
            prompt_rows.targets.extend(targets)
            assert state.sampling is not None
            top = state.sampling.prompt_logprobs or 0
            prompt_rows.spans.append((work.seq_id, len(targets), top))
        for position, (start, count, output_index) in enumerate(_query_spans(work)):
            end = start + count
            token_ids.extend(work.token_ids[start - work.start_pos : end - work.start_pos])
            lora_slots.extend([work.lora_slot] * count)
            span = range(start, end)
            positions.extend(span)
            for group, group_table in enumerate(seq_tables):
                group_slots[group].extend(
                    group_table[p // block_size] * block_size + p % block_size for p in span
                )
                group_batch_tables[group].append(group_table[: -(-end // block_size)])
            cu_query_lens.append(len(token_ids))
            context_lens.append(end)
            if work.num_samples > 0:
                assert state.sampling is not None
                logits_rows.append(len(token_ids) - 1)
                sample_seq_ids.append(work.seq_id)
                bitmask = None if work.token_bitmask is None else work.token_bitmask[position]
                history = None if state.history is None else state.history[:end]
                requests.append(
                    SampleRequest(
                        state.sampling,
                        work.num_samples,
                        work.branch_index,
                        output_index,
                        bitmask,
                        history,
                    )
                )

    def tensor(values: list[int] | list[list[int]], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    def padded(tables: list[list[int]]) -> torch.Tensor:
        width = max((len(t) for t in tables), default=0)
        rows = [t + [0] * (width - len(t)) for t in tables]
        return tensor(rows, torch.int32).reshape(len(tables), width)

    tables = group_batch_tables[0]
    metadata = AttentionMetadata(
        positions=tensor(positions, torch.int64),
        slot_mapping=tensor(group_slots[0], torch.int64),
        cu_query_lens=tensor(cu_query_lens, torch.int32),
        context_lens=tensor(context_lens, torch.int32),
        block_tables=padded(tables),
        logits_indices=tensor(logits_rows, torch.int64),
        group_tables=[
            (tensor(group_slots[g], torch.int64), padded(group_batch_tables[g]))
            for g in range(1, groups)
        ],
    )
    any_lora = any(slot >= 0 for slot in lora_slots)
    return PackedBatch(
        tensor(token_ids, torch.int64),
        metadata,
        sample_seq_ids,
        requests,
        tensor(lora_slots, torch.int64) if any_lora else None,
        prompt_rows,
    )
