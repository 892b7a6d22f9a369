"""The engine's per-request state: a request and its sampling branches (one sequence each).

Invariants:
- `branch.token_ids == request.prompt_token_ids + branch.output_token_ids` always.
- Before a parallel request forks, only branch 0 holds a sequence in the block manager; the
  others are created up front (their seq ids reserved) and join at the fork.
- `worker_knows` says whether the workers hold the sequence's state (its sampling settings and
  a block table); what they hold of the table is the block manager's business
  (`KVManager.take_table_delta`).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from block_manager import CacheKey
from cluster.engine.detokenizer import TextTracker
from cluster.engine.handoff import text_final
from cluster.engine.output_stream import BranchDelta, RequestDelta
from cluster.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from cluster.engine.reasoning import TokenConstraint
from cluster.engine.sampling_params import SamplingParams
from cluster.engine.speculation import NgramIndex
from workers.plan import SampledToken, SamplingSettings


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass
class Branch:
    """One sampling branch: a sequence id, its tokens, text and finish state."""

    seq_id: int
    index: int
    token_ids: list[int]
    text: TextTracker
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprob] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    emitted_tokens: int = 0
    finish_streamed: bool = False
    """Its finish went out in a delta (a finished branch is in no later delta)."""
    worker_knows: bool = False
    ngrams: NgramIndex | None = None
    """Speculative decoding's n-gram index over `token_ids` (built on first use)."""
    grammar: TokenConstraint | None = None
    """Structured outputs: this branch's matcher, advanced by each kept output token."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def forget_worker_state(self) -> None:
        self.worker_knows = False


@dataclass
class Request:
    """One request: the prompt, its parameters, its branches and where it stands."""

    request_id: str
    arrival_index: int
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    settings: SamplingSettings
    cache_key: CacheKey
    max_tokens: int
    branches: list[Branch]
    metrics: RequestMetrics
    status: RequestStatus = RequestStatus.WAITING
    forked: bool = False
    num_cached_tokens: int | None = None
    swapped_blocks: int = 0
    error: str | None = None
    failed: bool = False
    """Ended by a failed step (see `EngineCore.finish_step`); `error` says why."""
    announced: bool = False
    """A delta or output was made already (the prompt travels with the first one only)."""
    adapter_name: str | None = None
    """The LoRA adapter's name as the caller gave it (None: the base model); metrics key."""
    adapter_digest: str | None = None
    """The adapter's weights digest: what the scheduler's slot limit and the slots key on."""
    prefill_only: bool = False
    """Ends after its first token, handed off to a decode engine (`cluster.engine.handoff`)."""
    prompt_logprobs: list[Logprob | None] | None = None
    """With `params.prompt_logprobs`: one entry per prompt token recorded so far (the first is
    None: nothing predicts it), filled in position order as the prompt's chunks run."""
    prompt_logprobs_sent: bool = False
    """The complete prompt logprobs went out in a delta (they travel once)."""
    priority: int = 0
    """Scheduling priority (lower runs first); 0 for every request under `fcfs`."""

    @property
    def queue_order(self) -> tuple[int, int]:
        """Where the request stands in every scheduler queue: by priority, then arrival (under
        `fcfs` every priority is 0, so arrival order alone)."""
        return (self.priority, self.arrival_index)

    def record_prompt_logprobs(self, first_position: int, entries: Sequence[SampledToken]) -> None:
        """Records the log-probabilities of the prompt tokens at `first_position`, ... (a
        recomputed chunk's entries for positions recorded already are dropped)."""
        recorded = self.prompt_logprobs
        if recorded is None:
            return
        if first_position > len(recorded):
            raise RuntimeError(
                f"request {self.request_id}: prompt logprobs from position {first_position}, "
                f"but only {len(recorded)} are recorded"
            )
        for entry in entries[len(recorded) - first_position :]:
            top = dict(entry.top_logprobs) if entry.top_logprobs else {}
            recorded.append(Logprob(entry.token_id, entry.logprob, top))

    def complete_prompt_logprobs(self) -> list[Logprob | None] | None:
        """The prompt logprobs once every prompt token has its entry, else None."""
        recorded = self.prompt_logprobs
        if recorded is None or len(recorded) < len(self.prompt_token_ids):
            return None
        return recorded

    @property
    def n(self) -> int:
        return len(self.branches)

    @property
    def active_branches(self) -> list[Branch]:
        """Unfinished branches that own (or, once admitted, will own) a sequence."""
        branches = self.branches
        if not self.forked or len(branches) == 1:
            first = branches[0]
            return [] if first.finish_reason is not None else [first]
        return [b for b in branches if b.finish_reason is None]

    @property
    def finished(self) -> bool:
        return all(b.finished for b in self.branches)

    def make_delta(self) -> RequestDelta:
        """What is new since the previous delta or output: the branches with new tokens or text
        and those that have just finished (each finish is in exactly one delta); advances each
        branch's streamed position. Costs O(new tokens): nothing cumulative is copied (see
        `output_stream`)."""
        first = not self.announced
        self.announced = True
        branches = []
        for branch in self.branches:
            start = branch.emitted_tokens
            text = branch.text.take_delta(finished=text_final(branch))
            newly_finished = branch.finished and not branch.finish_streamed
            if not (text or start < len(branch.output_token_ids) or newly_finished):
                continue
            branch.emitted_tokens = len(branch.output_token_ids)
            branch.finish_streamed = branch.finished
            branches.append(
                BranchDelta(
                    index=branch.index,
                    text=text,
                    token_ids=branch.output_token_ids[start:],
                    logprobs=branch.logprobs[start:] if branch.logprobs is not None else None,
                    cumulative_logprob=branch.cumulative_logprob,
                    finish_reason=branch.finish_reason,
                    stop_reason=branch.stop_reason,
                )
            )
        finished = self.finished
        prompt_logprobs = None
        if not self.prompt_logprobs_sent:
            prompt_logprobs = self.complete_prompt_logprobs()
            self.prompt_logprobs_sent = prompt_logprobs is not None
        return RequestDelta(
            request_id=self.request_id,
            branches=branches,
            finished=finished,
            num_cached_tokens=self.num_cached_tokens or 0,
            error=self.error,
            prompt=self.prompt if first else None,
            prompt_token_ids=self.prompt_token_ids if first else None,
            metrics=self.metrics if first or finished else None,
            prompt_logprobs=prompt_logprobs,
        )

    def make_output(self) -> RequestOutput:
        """A snapshot with copies of everything so far (the offline path); advances each
        branch's streamed position (deltas are since the last one). Streams use `make_delta`."""
        self.announced = True
        outputs = []
        for branch in self.branches:
            delta_text = branch.text.take_delta(finished=text_final(branch))
            delta_ids = branch.output_token_ids[branch.emitted_tokens :]
            branch.emitted_tokens = len(branch.output_token_ids)
            outputs.append(
                CompletionOutput(
                    index=branch.index,
                    text=branch.text.streamed_text,
                    token_ids=list(branch.output_token_ids),
                    cumulative_logprob=branch.cumulative_logprob,
                    logprobs=list(branch.logprobs) if branch.logprobs is not None else None,
                    finish_reason=branch.finish_reason,
                    stop_reason=branch.stop_reason,
                    delta_text=delta_text,
                    delta_token_ids=delta_ids,
                )
            )
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=list(self.prompt_token_ids),
            outputs=outputs,
            finished=self.finished,
            num_cached_tokens=self.num_cached_tokens or 0,
            metrics=self.metrics,
            error=self.error,
            prompt_logprobs=(None if self.prompt_logprobs is None else list(self.prompt_logprobs)),
        )
