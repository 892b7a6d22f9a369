"""`ScreenedHead` (bfloat16 screening, float32 refinement) against the plain float32 LM head."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from workers.layers import VocabParallelEmbedding
from workers.lm_head import CHUNK, ScreenedHead
from workers.parallel import TensorParallel


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


class _OneShardOfTwo(TensorParallel):
    """Rank 1 of 2 whose gather returns its own shard (no process group needed)."""

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


class _Reader:
    """A `CheckpointReader` stand-in serving one tensor's row range."""

    def __init__(self, full: torch.Tensor) -> None:
        self.full = full

    def read(
        self, name: str, shape: tuple[int, ...], dim: int = 0, start: int = 0, stop: int = -1
    ) -> torch.Tensor:
        assert tuple(self.full.shape) == shape
        return self.full.narrow(dim, start, stop - start)


@pytest.mark.parametrize("world", [1, 2])
def test_screened_vocab_parallel_head_matches_its_float32_shard(world: int) -> None:
    """The LM head of a reduced model screens after `load`; a rank whose shard is padded (vocab
    not divisible by the ranks) returns zero logits for its padding rows, as the plain head."""
    vocab, hidden = CHUNK * 7 + 5, 48
    full, states = _weights(vocab, hidden, seed=world)
    tp = _OneShardOfTwo(rank=1, world_size=2) if world == 2 else TensorParallel()
    head = VocabParallelEmbedding(vocab, hidden, tp, torch.float32, screened=True)
    head.load(_Reader(full), "lm_head.weight")  # type: ignore[arg-type]
    assert head.screen is not None
    plain = F.linear(states, head.weight)
    got = head.logits(states)
    if world == 2:  # rank 1 owns rows [rows_per_rank, vocab) and pads the rest with zeros
        rows = vocab - head.start
        assert got.shape == (states.shape[0], head.weight.shape[0])
        assert torch.equal(got[:, rows:], torch.zeros_like(got[:, rows:]))
        plain, got = plain[:, :rows], got[:, :rows]
    assert torch.equal(got.argmax(1), plain.argmax(1))
    torch.testing.assert_close(got.amax(1), plain.amax(1), rtol=1e-6, atol=1e-5)
