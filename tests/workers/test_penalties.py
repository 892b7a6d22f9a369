"""The sampler's logits processors against independent oracles: HF transformers' own processors
(repetition penalty, min-p, min new tokens, sequence bias) and plain-Python formulas (OpenAI's
frequency and presence penalties); and the rank's per-sequence token history they read."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch
from transformers import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from workers.batch import SequenceRegistry, pack_batch
from workers.penalties import penalized_logits
from workers.plan import PlanRejected, SamplingSettings, SequenceWork, StepPlan
from workers.sampling import SampleRequest, filtered_probabilities, sample_rows

VOCAB = 50


def _logits(seed: int, rows: int = 1) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _history(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(length)]


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_equals_hf_over_prompt_and_output(penalty: float) -> None:
    for seed in range(5):
        logits = _logits(seed)
        history = _history(seed, 30)
        settings = SamplingSettings(repetition_penalty=penalty, prompt_len=12)
        ours = penalized_logits(logits, [(settings, 18, history)])
        expected = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([history]), logits)
        torch.testing.assert_close(ours, expected, rtol=0, atol=0)


def test_frequency_and_presence_penalties_follow_openais_formula_on_output_tokens() -> None:
    for seed in range(5):
        logits = _logits(seed)
        history = _history(seed, 40)
        prompt_len = 15
        settings = SamplingSettings(
            frequency_penalty=0.7, presence_penalty=-0.4, prompt_len=prompt_len
        )
        ours = penalized_logits(logits, [(settings, 25, history)])[0].tolist()
        outputs = history[prompt_len:]
        for token in range(VOCAB):
            count = outputs.count(token)  # the prompt's occurrences do not count
            expected = logits[0, token].item() - 0.7 * count - (-0.4 if count else 0.0)
            assert math.isclose(ours[token], expected, rel_tol=1e-6, abs_tol=1e-5), token


def test_logit_bias_equals_hf_sequence_bias_of_single_tokens() -> None:
    logits = _logits(3)
    bias = {4: 2.5, 17: -100.0, 49: 0.25}
    settings = SamplingSettings(logit_bias=tuple(sorted(bias.items())))
    ours = penalized_logits(logits, [(settings, 0, None)])
    hf = SequenceBiasLogitsProcessor({(token,): value for token, value in bias.items()})
    expected = hf(torch.tensor([[1, 2, 3]]), logits.clone())
    torch.testing.assert_close(ours, expected)


@pytest.mark.parametrize("output_index", [0, 2, 3, 7])
def test_min_tokens_bans_stop_tokens_as_hf_min_new_tokens(output_index: int) -> None:
    logits = _logits(5)
    stops = (3, 11)
    settings = SamplingSettings(min_tokens=3, stop_token_ids=stops, prompt_len=4)
    ours = penalized_logits(logits, [(settings, output_index, None)])
    prompt_and_output = torch.tensor([[1] * (4 + output_index)])
    hf = MinNewTokensLengthLogitsProcessor(4, 3, list(stops))
    expected = hf(prompt_and_output, logits.clone())
    torch.testing.assert_close(ours, expected)
    banned = output_index < 3
    assert all(math.isinf(ours[0, t].item()) == banned for t in stops)


def test_min_tokens_yields_to_a_grammar_that_allows_only_a_stop_token() -> None:
    """A row with nothing left but a banned stop token keeps it: the grammar wins."""
    logits = torch.full((1, VOCAB), float("-inf"))
    logits[0, 3] = 0.0
    settings = SamplingSettings(temperature=0.0, min_tokens=5, stop_token_ids=(3,))
    request = SampleRequest(settings, 1, 0, 0)
    assert sample_rows(logits, [request], 0)[0][0].token_id == 3


@pytest.mark.parametrize("min_p", [0.05, 0.3, 0.9])
@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.5])
def test_min_p_keeps_the_tokens_hf_min_p_keeps(min_p: float, temperature: float) -> None:
    logits = _logits(8)[0]
    ours = filtered_probabilities(logits, SamplingSettings(temperature=temperature, min_p=min_p))
    warped = MinPLogitsWarper(min_p)(torch.zeros(1, 1), (logits / temperature).unsqueeze(0))
    expected = torch.softmax(warped[0], dim=-1)
    torch.testing.assert_close(ours, expected)
    assert 1 <= int((ours > 0).sum()) < VOCAB


def test_greedy_takes_the_penalized_maximum_and_logprobs_stay_the_models() -> None:
    logits = torch.tensor([[5.0, 4.0, 1.0, 0.0]])
    settings = SamplingSettings(temperature=0.0, frequency_penalty=2.0, prompt_len=1, logprobs=1)
    request = SampleRequest(settings, 1, 0, 2, history=[3, 0, 0])  # token 0 is out twice
    drawn = sample_rows(logits, [request], 0)[0][0]
    assert drawn.token_id == 1  # 5 - 2 * 2 = 1 < 4
    raw = torch.log_softmax(logits[0], dim=-1)
    assert drawn.logprob == pytest.approx(raw[1].item())
    assert drawn.top_logprobs[0][0] == 0  # the model's own top token


def test_rows_without_processors_are_untouched_and_not_copied() -> None:
    logits = _logits(1, rows=3)
    plain = [(SamplingSettings(), 0, None)] * 3
    assert penalized_logits(logits, plain) is logits
    mixed = [plain[0], (SamplingSettings(presence_penalty=1.0), 1, [1, 2]), plain[2]]
    processed = penalized_logits(logits, mixed)
    torch.testing.assert_close(processed[[0, 2]], logits[[0, 2]], rtol=0, atol=0)
    assert processed[1, 2].item() == pytest.approx(logits[1, 2].item() - 1.0)


# --- the rank's token history --------------------------------------------------------------

PENALIZED = SamplingSettings(repetition_penalty=1.5, prompt_len=3)


def _work(seq_id: int, tokens: list[int], start: int, **fields: object) -> SequenceWork:
    blocks = list(range(-(-(start + len(tokens)) // 4)))
    work = SequenceWork(seq_id, tokens, start, 0, blocks, num_samples=1)
    return dataclasses.replace(work, **fields)  # type: ignore[arg-type]


def _histories(registry: SequenceRegistry, plan: StepPlan) -> list[list[int] | None]:
    registry.apply(plan)
    batch = pack_batch(plan, registry, 4, torch.device("cpu"))
    return [request.history for request in batch.sample_requests]


def test_history_starts_from_the_sent_prefix_and_follows_the_fed_tokens() -> None:
    registry = SequenceRegistry()
    first = _work(1, [7, 8, 9], 2, sampling=PENALIZED, history=[5, 6])  # 2 tokens were cached
    assert _histories(registry, StepPlan(1, [first])) == [[5, 6, 7, 8, 9]]
    assert _histories(registry, StepPlan(2, [_work(1, [10], 5)])) == [[5, 6, 7, 8, 9, 10]]


def test_a_speculative_step_sees_each_positions_prefix_and_a_rewind_drops_drafts() -> None:
    registry = SequenceRegistry()
    _histories(registry, StepPlan(1, [_work(1, [1, 2, 3], 0, sampling=PENALIZED, history=[])]))
    drafts = _work(1, [4, 40, 41], 3, num_draft_tokens=2)
    assert _histories(registry, StepPlan(2, [drafts])) == [
        [1, 2, 3, 4],
        [1, 2, 3, 4, 40],
        [1, 2, 3, 4, 40, 41],
    ]
    # the first draft was accepted, the second was not: the next step starts at position 5
    assert _histories(registry, StepPlan(3, [_work(1, [50], 5)])) == [[1, 2, 3, 4, 40, 50]]


def test_a_fork_copies_the_history_and_branches_then_diverge() -> None:
    registry = SequenceRegistry()
    _histories(registry, StepPlan(1, [_work(1, [1, 2, 3], 0, sampling=PENALIZED, history=[])]))
    plan = StepPlan(2, [_work(1, [4], 3), _work(2, [5], 3)], forks=[(1, 2)])
    assert _histories(registry, plan) == [[1, 2, 3, 4], [1, 2, 3, 5]]


def test_penalties_without_their_history_are_refused_and_the_registry_kept() -> None:
    registry = SequenceRegistry()
    with pytest.raises(PlanRejected, match="earlier tokens"):
        _histories(registry, StepPlan(1, [_work(1, [1, 2], 0, sampling=PENALIZED)]))
    registry = SequenceRegistry()
    _histories(registry, StepPlan(1, [_work(1, [1, 2, 3], 0, sampling=PENALIZED, history=[])]))
    with pytest.raises(PlanRejected, match="only 3 of its tokens"):
        registry.apply(StepPlan(2, [_work(1, [9], 5)]))
    assert registry.states[1].history == [1, 2, 3]


def test_unpenalized_sequences_keep_no_history() -> None:
    registry = SequenceRegistry()
    plan = StepPlan(1, [_work(1, [1, 2, 3], 0, sampling=SamplingSettings())])
    assert _histories(registry, plan) == [None]
    assert registry.states[1].history is None
