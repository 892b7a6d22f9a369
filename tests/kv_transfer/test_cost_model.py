"""Copy or compute: the cost model against hand-computed predictions."""

from __future__ import annotations

import pytest

from cluster.kv_transfer.cost_model import TransferCostModel


def test_priors_until_a_pull_is_measured_then_smoothed_figures() -> None:
    model = TransferCostModel(bandwidth_prior_bytes_per_s=1e8, latency_prior_s=0.01, smoothing=0.5)
    assert model.copy_seconds("a", 10**7) == pytest.approx(0.01 + 0.1)
    # 10 MB in 0.1 s, nothing fixed known: 1e8 B/s, latency 0
    model.observe("a", 10**7, 0.1, fixed_seconds=0.0)
    assert model.bandwidth["a"] == pytest.approx(1e8)
    model.observe("a", 10**7, 0.05, fixed_seconds=0.0)  # 2e8 B/s, halfway: 1.5e8
    assert model.bandwidth["a"] == pytest.approx(1.5e8)
    assert model.copy_seconds("a", 3 * 10**7) == pytest.approx(0.2)
    assert model.copy_seconds("b", 0) == pytest.approx(0.01)  # another holder: the priors


def test_prefers_the_copy_only_when_it_is_predicted_faster() -> None:
    model = TransferCostModel(bandwidth_prior_bytes_per_s=1e8, latency_prior_s=0.0)
    # 64 blocks of 368,640 B = 0.236 s against 1024 tokens at 1 ms = 1.024 s: copy
    assert model.prefer_copy("a", 64 * 368_640, 1024, 1e-3)
    # the same tokens at 0.1 ms each (0.102 s): compute
    assert not model.prefer_copy("a", 64 * 368_640, 1024, 1e-4)


def test_bad_priors_are_refused() -> None:
    with pytest.raises(ValueError):
        TransferCostModel(bandwidth_prior_bytes_per_s=0)
    with pytest.raises(ValueError):
        TransferCostModel(smoothing=0)
