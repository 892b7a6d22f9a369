"""A step between its two halves: what `EngineCore.advance_step` applied and `settle_step` owes.

`advance_step` applies what the next schedule depends on (KV marked computed, the sampled token
ids appended, the finishes that need no text, blocks freed); `settle_step` does the rest (text,
stop strings, log-probabilities, latency metrics) and returns the requests to report. With async
scheduling the next step runs on the workers in between.

Invariant: every token in `tokens` was appended to its branch by `advance_step`, in the order
the step sampled them; `settle_step` handles each exactly once.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from block_manager import KVManager
from cluster.engine.output_processor import TokenEnd, apply_token_text
from cluster.engine.request import Branch, Request
from cluster.engine.scheduler_step import SchedulerStep
from workers.plan import SampledToken


@dataclass
class AppliedToken:
    """One sampled token appended to its branch, its text still to do."""

    request: Request
    branch: Branch
    sampled: SampledToken
    end: TokenEnd | None
    """What ended the branch at this token without looking at the text (None: running)."""
    num_output_tokens: int
    """The branch's output length with this token (where a stop string found later cuts)."""
    text_done: bool = False
    """Its text was applied in the first half already (a prefill-only request's token: the
    text decides between a stop and the hand-off)."""


@dataclass
class StepProgress:
    step: SchedulerStep
    now: float
    """When the step's output was applied (its tokens' time for TTFT / TPOT)."""
    tokens: list[AppliedToken] = field(default_factory=list)
    reported: list[Request] = field(default_factory=list)
    """Requests the first half ended already (refused, failed, rejected); reported first."""


@dataclass
class TextResults:
    """What `apply_texts` made of a step's tokens."""

    new_tokens: dict[str, tuple[Request, int]] = field(default_factory=dict)
    """Request id -> (request, tokens it kept this step): the requests to report."""
    cut: list[tuple[Request, Branch]] = field(default_factory=list)
    """Running branches a stop string ended (to finish in the scheduler)."""
    broken: dict[str, tuple[Request, str]] = field(default_factory=dict)
    """Request id -> (request, why): a token's text raised; the request is to fail alone."""


def apply_texts(tokens: list[AppliedToken]) -> TextResults:
    """Applies each token's text in order (`apply_token_text`). A branch a stop string ends
    keeps its tokens up to that one (later ones of a speculative step are removed from it); a
    request whose text raises keeps nothing more of the step."""
    results = TextResults()
    cut: set[int] = set()
    for applied in tokens:
        request, branch = applied.request, applied.branch
        rid = request.request_id
        if rid in results.broken or branch.seq_id in cut:
            continue
        counted = results.new_tokens.get(rid)
        results.new_tokens[rid] = (request, 1 if counted is None else counted[1] + 1)
        if applied.text_done:
            continue
        try:
            if apply_token_text(request, branch, applied.sampled, applied.end):
                cut.add(branch.seq_id)
                _truncate(branch, applied.num_output_tokens)
                results.cut.append((request, branch))
        except Exception as error:  # this request's token only: it fails alone
            results.broken[rid] = (request, f"{type(error).__name__}: {error}")
            results.new_tokens.pop(rid, None)
    return results


def _truncate(branch: Branch, num_output_tokens: int) -> None:
    dropped = len(branch.output_token_ids) - num_output_tokens
    if dropped:
        del branch.output_token_ids[num_output_tokens:]
        del branch.token_ids[-dropped:]


def holders_of(bm: KVManager, running: Iterable[Request], blocks: set[int]) -> list[Request]:
    """The running requests with a resident branch whose device table holds one of `blocks`."""
    return [
        request
        for request in running
        if any(
            bm.has_sequence(b.seq_id)
            and not bm.is_swapped(b.seq_id)
            and not blocks.isdisjoint(bm.block_table(b.seq_id))
            for b in request.active_branches
        )
    ]
