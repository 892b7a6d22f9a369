"""`ScreenedHead` (bfloat16 screening, float32 refinement) against the plain float32 LM head."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from workers.lm_head import CHUNK, ScreenedHead


def _weights(vocab: int, hidden: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight with near-duplicate rows (near ties everywhere) and hidden states with one
    outlier feature, as real final-norm outputs have."""
    generator = torch.Generator().manual_seed(seed)
    base = torch.randn(vocab // 8 + 1, hidden, generator=generator) * 0.1
    weight = base.repeat_interleave(8, 0)[:vocab].clone()
    weight += torch.randn(vocab, hidden, generator=generator) * 1e-4
    states = torch.randn(24, hidden, generator=generator)
    states[:, 3] *= 40.0
    return weight, states


@pytest.mark.parametrize("vocab", [CHUNK * 40, CHUNK * 40 + 17, 5])
def test_screened_argmax_and_top_logits_are_float32(vocab: int) -> None:
    weight, states = _weights(vocab, 96, seed=vocab)
    head = ScreenedHead.of(weight)
    exact = F.linear(states, weight)
    got = head.logits(states)
    assert got.shape == exact.shape and got.dtype == torch.float32
    assert torch.equal(got.argmax(1), exact.argmax(1))
    torch.testing.assert_close(got.amax(1), exact.amax(1), rtol=1e-6, atol=1e-5)
    # every logit stays within the bfloat16 estimate's error of the float32 one
    bfloat16_only = F.linear(states.bfloat16(), weight.bfloat16()).float()
    worst = (bfloat16_only - exact).abs().max()
    assert float((got - exact).abs().max()) <= float(worst) + 1e-5


def test_screened_batch_of_one_and_near_ties_in_bfloat16() -> None:
    """Rows whose top logits differ by less than bfloat16 resolves: still float32's choice."""
    weight, _ = _weights(CHUNK * 16, 64, seed=7)
    winner = weight[100].clone()
    weight[101] = winner
    weight[101, 0] += 1e-3  # h[0] > 0 below: row 101 wins by about 1e-3 * h[0]
    state = winner.sign() * 3.0
    state[0] = 5.0
    head = ScreenedHead.of(weight)
    got = head.logits(state[None, :])
    exact = F.linear(state[None, :], weight)
    assert int(exact.argmax()) == 101
    assert int(got.argmax()) == 101
    assert float(got[0, 101] - got[0, 100]) == pytest.approx(float(exact[0, 101] - exact[0, 100]))


def test_screened_head_rejects_reduced_weights() -> None:
    with pytest.raises(ValueError, match="float32"):
        ScreenedHead.of(torch.zeros(4, 4, dtype=torch.bfloat16))
