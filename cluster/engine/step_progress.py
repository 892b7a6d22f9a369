"""A step between its two halves: what `EngineCore.advance_step` applied and `settle_step` owes.

`advance_step` applies what the next schedule depends on (KV marked computed, the sampled token
ids appended, the finishes that need no text, blocks freed); `settle_step` does the rest (text,
stop strings, log-probabilities, latency metrics) and returns the requests to report. With async
scheduling the next step runs on the workers in between.

Invariant: every token in `tokens` was appended to its branch by `advance_step`, in the order
the step sampled them; `settle_step` handles each exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cluster.engine.output_processor import TokenEnd
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
