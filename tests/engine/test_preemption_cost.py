"""The `auto` preemption cost model: swap when moving the blocks twice is cheaper than
recomputing the tokens, with the compute cost learned from the steps that ran."""

from __future__ import annotations

import pytest

from cluster.engine.preemption import PreemptionCostModel


def test_prefers_the_cheaper_side() -> None:
    model = PreemptionCostModel(kv_bytes_per_block=1_000_000, swap_bytes_per_second=1e9)
    # 10 blocks out and back: 20 ms; 100 tokens at the initial 1 ms each: 100 ms
    assert model.swap_seconds(10) == pytest.approx(0.02)
    assert model.prefer_swap(tokens_to_recompute=100, num_blocks=10)
    assert not model.prefer_swap(tokens_to_recompute=10, num_blocks=10)


def test_learns_compute_cost_from_steps() -> None:
    model = PreemptionCostModel(kv_bytes_per_block=1_000_000, swap_bytes_per_second=1e9)
    for _ in range(60):
        model.observe_step(forward_seconds=0.001, num_tokens=100)  # 10 us per token
    assert model.seconds_per_token == pytest.approx(1e-5, rel=1e-3)
    assert not model.prefer_swap(tokens_to_recompute=100, num_blocks=10)
    model.observe_step(forward_seconds=0.0, num_tokens=0)  # an empty step teaches nothing
    assert model.seconds_per_token == pytest.approx(1e-5, rel=1e-3)
