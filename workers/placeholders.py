"""Placeholder tokens of async scheduling, filled on the worker side.

With async scheduling the engine plans step N+1 while step N runs: a sequence decoding in step N
gets, in step N+1, one `SequenceWork` whose only token is a placeholder (`placeholder`: its slot
and position are known, its id is the token step N is sampling). Whoever executes plans (the
worker group, or a stand-in for it) keeps the output of the plan it ran last and, before running
the next one, writes each placeholder's token from it (`PlaceholderFiller`; its `run` does both
around one execution).

Invariants: a plan with placeholders names the plan they refer to (`StepPlan.placeholders_of`),
which is the one executed just before it; a placeholder is filled only from that plan's output.
When that output is missing (the previous plan failed, or the executor ran something else in
between) the placeholder's work is dropped from the plan: it samples nothing, and the engine,
which has sent those sequences back or ended them when it judged the failed plan, ignores it.
Everything else in the plan (releases, copies, other sequences) runs as planned.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import TypeVar

from workers.plan import StepOutput, StepPlan

Extra = TypeVar("Extra")
"""What an execution returns beside the step's output (e.g. logits), passed through."""


class PlaceholderFiller:
    """The last executed plan's output, kept to fill the next plan's placeholders."""

    def __init__(self) -> None:
        self._last: StepOutput | None = None

    def fill(self, plan: StepPlan) -> StepPlan:
        """`plan` with every placeholder written from the previous plan's sampled tokens (in
        place: the plan's placeholder works are the executor's to fill), or a copy without the
        works it cannot fill. A plan without placeholders is returned as it is."""
        if plan.placeholders_of is None:
            return plan
        last = self._last
        samples = last.samples if last is not None and last.step_id == plan.placeholders_of else {}
        unfilled = False
        for work in plan.sequences:
            if work.placeholder:
                tokens = samples.get(work.seq_id)
                if tokens:
                    work.token_ids = [tokens[-1].token_id]
                else:
                    unfilled = True
        if not unfilled:
            return plan
        kept = [w for w in plan.sequences if not w.placeholder or samples.get(w.seq_id)]
        return dataclasses.replace(plan, sequences=kept)

    def record(self, output: StepOutput | None) -> None:
        """The plan just executed gave `output` (None: it failed)."""
        self._last = output

    def run(
        self,
        plan: StepPlan,
        execute: Callable[[StepPlan], tuple[StepOutput | None, Extra]],
    ) -> tuple[StepOutput | None, Extra]:
        """`execute(plan)` with `plan`'s placeholders filled (`fill`), its output recorded for
        the next plan. Nothing is recorded while it runs, so a plan that raises leaves nothing
        to fill from (its exception propagates)."""
        output, extra = execute(self._begin(plan))
        self.record(output)
        return output, extra

    async def run_async(
        self,
        plan: StepPlan,
        execute: Callable[[StepPlan], Awaitable[tuple[StepOutput | None, Extra]]],
    ) -> tuple[StepOutput | None, Extra]:
        """`run` for an awaitable execution. The caller keeps plans in order: the next one may
        start only after this one's output is recorded."""
        output, extra = await execute(self._begin(plan))
        self.record(output)
        return output, extra

    def _begin(self, plan: StepPlan) -> StepPlan:
        """`plan` filled, the previous output forgotten: until this plan's output is recorded
        there is nothing to fill a later plan from."""
        filled = self.fill(plan)
        self.record(None)
        return filled
