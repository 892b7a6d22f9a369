"""The sampler against plain-Python oracles: filters, frequencies, stateless seeds, logprobs."""

from __future__ import annotations

import collections
import math

import pytest
import torch

from workers import SamplingSettings, SequenceWork, StepPlan, WorkerGroup
from workers.sampling import SampleRequest, draw, filtered_probabilities, sample_rows

LOGITS = [2.0, 1.5, 0.3, -1.0, 0.9, -3.0]


def _request(num_samples: int = 1, output_index: int = 0, **settings: float) -> SampleRequest:
    return SampleRequest(SamplingSettings(**settings), num_samples, 0, output_index)  # type: ignore[arg-type]


def _draws(count: int, **settings: float) -> collections.Counter[int]:
    rows = torch.tensor([LOGITS] * count)
    requests = [_request(output_index=i, **settings) for i in range(count)]
    return collections.Counter(t[0].token_id for t in sample_rows(rows, requests, worker_seed=0))


def _softmax(values: list[float]) -> list[float]:
    peak = max(values)
    weights = [math.exp(v - peak) for v in values]
    return [w / sum(weights) for w in weights]


def test_greedy_is_argmax_for_every_sample() -> None:
    tokens = sample_rows(torch.tensor([LOGITS]), [_request(3, temperature=0.0)], 0)[0]
    assert [t.token_id for t in tokens] == [0, 0, 0]


def test_greedy_rows_of_a_mixed_batch_take_each_rows_first_maximum() -> None:
    """Greedy rows beside sampled ones, ties and a masked-out row maximum included: each
    greedy row gets the first index of its own maximum (plain Python's oracle)."""
    generator = torch.Generator().manual_seed(3)
    rows = torch.randint(-4, 4, (9, 300), generator=generator).float()  # many exact ties
    rows[4, 17] = float("-inf")
    requests = [
        _request(temperature=0.0) if index % 3 else _request(temperature=1.0, seed=index)
        for index in range(9)
    ]
    results = sample_rows(rows.clone(), requests, worker_seed=0)
    for index, (values, tokens) in enumerate(zip(rows.tolist(), results, strict=True)):
        if index % 3:
            assert [t.token_id for t in tokens] == [values.index(max(values))]
        else:
            assert 0 <= tokens[0].token_id < 300


def test_frequencies_follow_the_tempered_softmax() -> None:
    draws = 3000
    counts = _draws(draws, temperature=0.7)
    expected = _softmax([v / 0.7 for v in LOGITS])
    for token, probability in enumerate(expected):
        spread = 4 * math.sqrt(probability * (1 - probability) / draws) + 1e-3
        assert abs(counts[token] / draws - probability) <= spread


def test_top_k_and_top_p_keep_only_their_tokens() -> None:
    assert set(_draws(600, top_k=2)) <= {0, 1}
    assert set(_draws(600, top_k=2)) == {0, 1}
    probabilities = _softmax(LOGITS)
    order = sorted(range(len(LOGITS)), key=lambda i: -probabilities[i])
    nucleus, mass = [], 0.0
    for token in order:
        if mass >= 0.8:
            break
        nucleus.append(token)
        mass += probabilities[token]
    assert set(_draws(600, top_p=0.8)) == set(nucleus)
    assert set(_draws(50, top_p=1e-6)) == {0}


def test_draws_are_stateless_per_seed_branch_and_index() -> None:
    row = torch.tensor([LOGITS])
    alone = sample_rows(row, [SampleRequest(SamplingSettings(seed=9), 4, 2, 5)], 0)[0]
    batch = torch.tensor([[0.0] * 6, LOGITS])
    requests = [_request(), SampleRequest(SamplingSettings(seed=9), 4, 2, 5)]
    assert sample_rows(batch, requests, 0)[1] == alone
    branch_three = sample_rows(row, [SampleRequest(SamplingSettings(seed=9), 1, 3, 5)], 0)[0]
    assert branch_three[0] == alone[1]
    seeds = [
        sample_rows(row, [SampleRequest(SamplingSettings(seed=s), 8, 0, 0)], 0)[0] for s in range(4)
    ]
    assert len({tuple(t.token_id for t in tokens) for tokens in seeds}) > 1


def test_logprobs_are_the_models_log_softmax() -> None:
    token = sample_rows(torch.tensor([LOGITS]), [_request(temperature=0.0, logprobs=2)], 0)[0][0]
    log_z = math.log(sum(math.exp(v) for v in LOGITS))
    assert token.token_id == 0
    assert token.logprob == pytest.approx(LOGITS[0] - log_z, abs=1e-5)
    assert token.top_logprobs is not None
    assert [t for t, _ in token.top_logprobs] == [0, 1]
    assert token.top_logprobs[1][1] == pytest.approx(LOGITS[1] - log_z, abs=1e-5)
    plain = sample_rows(torch.tensor([LOGITS]), [_request(temperature=0.0)], 0)[0][0]
    assert plain.logprob is None and plain.top_logprobs is None


def test_seeded_sampling_ignores_batch_composition(tiny_group: WorkerGroup) -> None:
    settings = SamplingSettings(temperature=1.0, top_p=0.9, seed=123)
    prompt = [9, 8, 7, 6, 5]
    alone = tiny_group.execute(
        StepPlan(300, [SequenceWork(40, prompt, 0, 0, [10, 11], 3, 0, 4, settings)])
    )
    crowd = tiny_group.execute(
        StepPlan(
            301,
            [
                SequenceWork(41, [1, 2, 3], 0, 0, [12], 1, sampling=settings),
                SequenceWork(42, prompt, 0, 0, [13, 14], 3, 0, 4, settings),
            ],
        )
    )
    assert crowd.samples[42] == alone.samples[40]
    tiny_group.execute(StepPlan(302, released=[40, 41, 42]))


def test_token_bitmask_masks_only_its_row() -> None:
    """Bit t % 32 of word t // 32 allows token t (checked bit by bit in Python); a masked row
    draws only allowed tokens, and the unmasked row beside it draws as it does alone."""
    from workers.sampling import apply_token_bitmasks, mask_disallowed

    vocab = 70
    allowed = {3, 31, 32, 64, 69}
    words = [0, 0, 0]
    for token in allowed:
        words[token // 32] |= 1 << (token % 32)
    bitmask = torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)
    row = torch.randn(vocab, generator=torch.Generator().manual_seed(0))
    masked = mask_disallowed(row, bitmask)
    assert {t for t in range(vocab) if masked[t] != float("-inf")} == allowed
    logits = torch.stack([row, row])
    batched = apply_token_bitmasks(
        logits, [SampleRequest(SamplingSettings(), 1, 0, 0, bitmask)] * 2
    )
    assert torch.equal(batched[0], masked) and torch.equal(batched[1], masked)
    settings = SamplingSettings(seed=5)
    constrained = SampleRequest(settings, 8, 0, 0, bitmask)
    plain = SampleRequest(settings, 8, 0, 0)
    drawn = sample_rows(logits, [constrained, plain], 0)
    assert {t.token_id for t in drawn[0]} <= allowed
    assert drawn[1] == sample_rows(logits[1:], [plain], 0)[0]


@pytest.mark.parametrize("scale", [0.05, 1.0, 6.0])
@pytest.mark.parametrize("top_p", [0.1, 0.5, 0.9, 0.999])
def test_nucleus_of_a_large_vocabulary_equals_a_full_sort(scale: float, top_p: float) -> None:
    """The nucleus found among the top k (k growing) is the one a full descending sort finds,
    from peaked rows (a handful of tokens) to flat ones (thousands: k grows past the first
    guess, up to the whole vocabulary)."""
    logits = torch.randn(5000, generator=torch.Generator().manual_seed(int(scale * 100))) * scale
    ours = filtered_probabilities(logits, SamplingSettings(top_p=top_p))
    probs = torch.softmax(logits.double(), dim=-1).tolist()
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    nucleus, mass = [], 0.0
    for token in order:
        if mass >= top_p:
            break
        nucleus.append(token)
        mass += probs[token]
    kept = set(torch.nonzero(ours).flatten().tolist())
    assert kept == set(nucleus)
    for token in nucleus:
        assert ours[token].item() == pytest.approx(probs[token] / mass, rel=1e-4)


def test_draws_from_a_large_vocabulary_follow_its_probabilities() -> None:
    """Inverse transform sampling over 5000 tokens: frequencies of the likeliest tokens and of
    the rest in bulk match their probabilities; a token of probability 0 is never drawn."""
    logits = torch.randn(5000, generator=torch.Generator().manual_seed(2)) * 2
    logits[::7] = float("-inf")
    probs = torch.softmax(logits, dim=-1)
    draws = 4000
    counts = collections.Counter(
        draw(None, probs, torch.Generator().manual_seed(seed)) for seed in range(draws)
    )
    assert all(token % 7 for token in counts)
    top = torch.topk(probs, 5).indices.tolist()
    for token in top:
        p = probs[token].item()
        assert abs(counts[token] / draws - p) <= 4 * math.sqrt(p * (1 - p) / draws) + 1e-3
    rest = 1 - sum(probs[t].item() for t in top)
    drawn_rest = sum(c for t, c in counts.items() if t not in top) / draws
    assert abs(drawn_rest - rest) <= 4 * math.sqrt(rest * (1 - rest) / draws) + 1e-3


def test_a_draw_maps_back_to_the_candidates_token_ids() -> None:
    ids = torch.tensor([40, 7, 19])
    probs = torch.tensor([0.0, 1.0, 0.0])
    assert {draw(ids, probs, torch.Generator().manual_seed(s)) for s in range(20)} == {7}
    with pytest.raises(ValueError, match="probability 0"):
        draw(None, torch.zeros(4), torch.Generator().manual_seed(0))
