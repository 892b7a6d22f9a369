"""Speculative decoding by n-gram prompt lookup (vLLM's `method: "ngram"`).

A decoding sequence whose last tokens (an n-gram, longest first from `prompt_lookup_max` down to
`prompt_lookup_min`) occurred earlier in its prompt or output proposes the tokens that followed
that occurrence as drafts. The step computes the pending token and the drafts together, one row
each, and samples every row as it would have been sampled without drafts: row i draws output
index `output_index + i` from its own logits with its own seed. The scheduler then keeps the
rows' tokens up to and including the first that differs from its draft (`accept`).

Invariant (what makes it exact): a row's logits depend only on its token, its position and the
KV before it, and a row's draw only on those logits and (seed, branch, output index). Every
kept row had all drafts before it accepted, so its KV prefix is the one plain decoding would
have built; the tokens are therefore the ones plain decoding samples, greedy or seeded, and only
the number of steps changes. (Where the model's products depend on the batch shape, as oneDNN's
bfloat16 products above the 4-bit kernels' row limit do, plain decoding has the same dependence.)

Drafts never preempt anything and never take the watermark's blocks: a draft that would need a
block the pool cannot spare is not proposed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from block_manager import KVManager, NoFreeBlocks
from cluster.engine.config import SpeculativeSettings

if TYPE_CHECKING:
    from cluster.engine.request import Branch, Request
    from cluster.engine.step_budget import StepBudget


class NgramIndex:
    """For each n-gram size, the latest position where each n-gram of a token list ended.

    Invariant: after `update(tokens)`, `latest[n][g]` is the largest `e < len(tokens)` with
    `tuple(tokens[e - n:e]) == g` (n-grams ending at the very last position are indexed one call
    later, so a lookup of the current suffix never finds itself). Token lists only grow.
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        self.sizes = range(min_n, max_n + 1)
        self.latest: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        self.indexed_end = 0
        """N-grams ending at positions `<= indexed_end` are indexed."""

    def update(self, tokens: list[int]) -> None:
        for end in range(self.indexed_end + 1, len(tokens)):
            for n in self.sizes:
                if end >= n:
                    self.latest[n][tuple(tokens[end - n : end])] = end
        self.indexed_end = max(self.indexed_end, len(tokens) - 1)

    def propose(self, tokens: list[int], count: int) -> list[int]:
        """Up to `count` tokens continuing `tokens` as its longest earlier-seen suffix was
        continued. The continuation may run into the proposal itself, so a repeating pattern
        continues for all `count` tokens."""
        if count <= 0:
            return []
        self.update(tokens)
        length = len(tokens)
        for n in reversed(self.sizes):
            if length < n:
                continue
            end = self.latest[n].get(tuple(tokens[length - n :]))
            if end is None:
                continue
            proposal: list[int] = []
            for offset in range(count):
                source = end + offset
                proposal.append(tokens[source] if source < length else proposal[source - length])
            return proposal
        return []


@dataclass
class SpeculationCounters:
    """vLLM's spec-decode counters: verification steps with drafts, drafts, accepted drafts."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    """How often the draft at position i (0-based) was accepted."""

    def copy(self) -> SpeculationCounters:
        return replace(self, accepted_per_position=list(self.accepted_per_position))


class DraftAllowance:
    """How many drafts each decode of one step may carry, in the order they are scheduled:
    `per_sequence` each, one more for the first `extra` of them."""

    def __init__(self, per_sequence: int, extra: int = 0) -> None:
        self.per_sequence = per_sequence
        self.extra = extra

    def next(self) -> int:
        if self.extra > 0:
            self.extra -= 1
            return self.per_sequence + 1
        return self.per_sequence


class NgramSpeculator:
    """Proposes drafts for a branch and counts how many of them the step accepted."""

    def __init__(self, settings: SpeculativeSettings) -> None:
        self.settings = settings
        self.counters = SpeculationCounters(
            accepted_per_position=[0] * settings.num_speculative_tokens
        )

    def allowance(self, decoding_sequences: int) -> DraftAllowance:
        """Drafts per decode for a step of `decoding_sequences` decodes: none from
        `speculative_disable_by_batch_size` decodes on; within `speculative_max_rows`, the
        rows left after one per decode, shared evenly (the earlier decodes take the remainder);
        else `num_speculative_tokens` each."""
        settings = self.settings
        k = settings.num_speculative_tokens
        limit = settings.speculative_disable_by_batch_size
        if decoding_sequences <= 0 or (limit is not None and decoding_sequences >= limit):
            return DraftAllowance(0)
        if settings.speculative_max_rows is None:
            return DraftAllowance(k)
        spare = max(0, settings.speculative_max_rows - decoding_sequences)
        per_sequence, extra = divmod(spare, decoding_sequences)
        if per_sequence >= k:
            return DraftAllowance(k)
        return DraftAllowance(per_sequence, extra)

    def draft_branch(
        self,
        bm: KVManager,
        request: Request,
        branch: Branch,
        budget: StepBudget,
        allowed: int,
        max_model_len: int | None,
    ) -> list[int]:
        """Proposes up to `allowed` drafts for a decoding branch and appends them to its table,
        as far as the step's budget, `max_tokens`, the model's length and the free blocks above
        the watermark allow (a draft never makes anyone wait or be preempted); the budget is
        charged for them. A constrained branch only drafts what its grammar accepts."""
        room = min(
            allowed,
            budget.tokens,
            request.max_tokens - len(branch.output_token_ids) - 1,
            (max_model_len or 1 << 62) - len(branch.token_ids),
        )
        if room <= 0:
            return []
        if branch.ngrams is None:
            branch.ngrams = self.new_index()
        grammar = branch.grammar
        if grammar is not None:
            grammar.sync(branch.output_token_ids)
        drafts = self.append_drafts(
            bm,
            branch.seq_id,
            branch.token_ids,
            branch.ngrams,
            room,
            None if grammar is None else grammar.valid_drafts,
        )
        budget.take_drafts(len(drafts))
        return drafts

    def append_drafts(
        self,
        bm: KVManager,
        seq_id: int,
        tokens: list[int],
        index: NgramIndex,
        room: int,
        valid_prefix: Callable[[list[int]], int] | None = None,
    ) -> list[int]:
        """Proposes up to `room` drafts continuing `tokens` (the sequence's, pending token
        included) and appends them to its table while blocks above the watermark allow, so a
        draft never makes a sequence wait or be preempted. Returns the appended drafts.

        `valid_prefix` (a constrained branch's grammar) says how many leading proposals are
        allowed; the rest are never appended, so no draft the grammar rejects is verified."""
        drafts: list[int] = []
        proposed = index.propose(tokens, room)
        if valid_prefix is not None:
            proposed = proposed[: valid_prefix(proposed)]
        for token in proposed:
            needs_block = bm.num_tokens(seq_id) % bm.block_size == 0
            if needs_block and bm.num_free_device_blocks() <= bm.watermark_blocks:
                break
            try:
                bm.append_token(seq_id, token)
            except NoFreeBlocks:  # a range layout that cannot grow its run now
                break
            drafts.append(token)
        return drafts

    def keep_accepted(
        self, bm: KVManager, seq_id: int, start: int, drafts: Sequence[int], drawn: list[int]
    ) -> int:
        """After the step: the rows from position `start` drew `drawn`. Keeps the rows up to and
        including the first that differs from its draft: the table is truncated to the pending
        token and the accepted drafts (the rejected drafts' slots are written again later) and
        marked computed. Returns how many of `drawn` to emit."""
        accepted = self.accept(drafts, drawn)
        kept = start + 1 + accepted
        bm.truncate(seq_id, kept)
        bm.mark_computed(seq_id, kept)
        return accepted + 1

    def new_index(self) -> NgramIndex:
        return NgramIndex(self.settings.prompt_lookup_min, self.settings.prompt_lookup_max)

    def accept(self, drafts: Sequence[int], sampled: list[int]) -> int:
        """How many leading drafts the rows' tokens confirm (`sampled[i]` is row i's token: the
        pending token's successor, then each draft's); counts them."""
        accepted = 0
        while accepted < len(drafts) and sampled[accepted] == drafts[accepted]:
            accepted += 1
        counters = self.counters
        counters.num_drafts += 1
        counters.num_draft_tokens += len(drafts)
        counters.num_accepted_tokens += accepted
        for position in range(accepted):
            counters.accepted_per_position[position] += 1
        return accepted
