"""`PlaceholderFiller`: a plan's placeholders take the token their sequence sampled in the plan
run just before, and only from that plan's output (oracle: the sampled tokens written by hand)."""

from __future__ import annotations

import asyncio

import pytest

from workers.placeholders import PlaceholderFiller
from workers.plan import PLACEHOLDER_TOKEN_ID, SampledToken, SequenceWork, StepOutput, StepPlan


def ahead_plan(step_id: int, base: int) -> StepPlan:
    return StepPlan(
        step_id=step_id,
        placeholders_of=base,
        sequences=[
            SequenceWork(seq_id=s, token_ids=[PLACEHOLDER_TOKEN_ID], start_pos=9, placeholder=True)
            for s in (1, 2)
        ]
        + [SequenceWork(seq_id=3, token_ids=[7, 8], start_pos=0, num_samples=1)],
        released=[5],
        copy_pairs=[(1, 2)],
    )


def output(step_id: int, samples: dict[int, int]) -> StepOutput:
    return StepOutput(step_id, {s: [SampledToken(t)] for s, t in samples.items()})


def test_placeholders_take_the_previous_plans_tokens() -> None:
    filler = PlaceholderFiller()
    filler.record(output(4, {1: 100, 2: 200, 9: 900}))
    plan = filler.fill(ahead_plan(5, base=4))
    assert [w.token_ids for w in plan.sequences] == [[100], [200], [7, 8]]


def test_placeholders_without_their_token_are_dropped_and_the_rest_runs() -> None:
    for previous in (None, output(3, {1: 100, 2: 200}), output(4, {2: 200})):
        filler = PlaceholderFiller()
        filler.record(previous)  # failed, another plan's output, a sequence missing
        plan = filler.fill(ahead_plan(5, base=4))
        expected = [[200], [7, 8]] if previous is not None and previous.step_id == 4 else [[7, 8]]
        assert [w.token_ids for w in plan.sequences] == expected
        assert (plan.step_id, plan.released, plan.copy_pairs) == (5, [5], [(1, 2)])


def test_a_plan_without_placeholders_is_left_as_it_is() -> None:
    filler = PlaceholderFiller()
    plan = StepPlan(step_id=2, sequences=[SequenceWork(seq_id=1, token_ids=[3], start_pos=0)])
    assert filler.fill(plan) is plan


def test_run_fills_the_plan_and_keeps_its_output_for_the_next() -> None:
    filler = PlaceholderFiller()
    seen: list[StepPlan] = []

    def execute(plan: StepPlan) -> tuple[StepOutput, str]:
        seen.append(plan)
        return output(plan.step_id, {1: 10 * plan.step_id, 2: 20 * plan.step_id}), "logits"

    first = StepPlan(step_id=4)
    assert filler.run(first, execute) == (output(4, {1: 40, 2: 80}), "logits")
    filler.run(ahead_plan(5, base=4), execute)
    assert [w.token_ids for w in seen[1].sequences] == [[40], [80], [7, 8]]


def test_a_plan_that_raises_in_run_leaves_nothing_to_fill_from() -> None:
    filler = PlaceholderFiller()
    filler.record(output(4, {1: 100, 2: 200}))

    def refuse(plan: StepPlan) -> tuple[StepOutput, None]:
        raise ValueError("refused")

    with pytest.raises(ValueError, match="refused"):
        filler.run(StepPlan(step_id=5), refuse)
    # the next plan names the failed one: its placeholders are dropped, the rest runs
    plan = filler.fill(ahead_plan(6, base=5))
    assert [w.token_ids for w in plan.sequences] == [[7, 8]]
    # nor does the output from before the failed plan fill a plan that names it
    assert [w.token_ids for w in filler.fill(ahead_plan(6, base=4)).sequences] == [[7, 8]]


def test_run_async_records_like_run() -> None:
    filler = PlaceholderFiller()
    seen: list[StepPlan] = []

    async def execute(plan: StepPlan) -> tuple[StepOutput, None]:
        seen.append(plan)
        if plan.step_id == 6:
            raise ValueError("refused")
        return output(plan.step_id, {1: 10 * plan.step_id, 2: 20 * plan.step_id}), None

    async def scenario() -> None:
        assert await filler.run_async(StepPlan(step_id=4), execute) == (
            output(4, {1: 40, 2: 80}),
            None,
        )
        await filler.run_async(ahead_plan(5, base=4), execute)
        with pytest.raises(ValueError, match="refused"):
            await filler.run_async(ahead_plan(6, base=5), execute)

    asyncio.run(scenario())
    assert [w.token_ids for w in seen[1].sequences] == [[40], [80], [7, 8]]
    assert [w.token_ids for w in seen[2].sequences] == [[50], [100], [7, 8]]
    assert [w.token_ids for w in filler.fill(ahead_plan(7, base=6)).sequences] == [[7, 8]]
