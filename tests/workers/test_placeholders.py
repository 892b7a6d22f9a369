"""`PlaceholderFiller`: a plan's placeholders take the token their sequence sampled in the plan
run just before, and only from that plan's output (oracle: the sampled tokens written by hand)."""

from __future__ import annotations

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
