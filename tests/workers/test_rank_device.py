"""Where a rank computes (workers/placement.py): one rule for Ray ranks in their bundles, the
local backend's rank, and the engine config's `auto` settings that depend on the device."""

from __future__ import annotations

import pathlib

import pytest
import torch

from cluster.engine.config import EngineConfig
from workers.cpu_features import AUTO_MAX_NUM_SEQS
from workers.placement import local_device, rank_device


@pytest.mark.parametrize(
    ("preference", "has_gpu", "device"),
    [("auto", True, "cuda"), ("auto", False, "cpu"), ("cpu", True, "cpu"), ("cuda", False, "cuda")],
)
def test_a_rank_computes_where_its_preference_and_its_gpu_say(
    preference: str, has_gpu: bool, device: str
) -> None:
    assert rank_device(preference, has_gpu) == device


@pytest.mark.parametrize("visible", [True, False])
def test_the_engine_config_takes_the_local_ranks_device(
    visible: bool, monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: visible)
    base = {"model": {"model": str(tmp_path)}, "scheduler": {"max_num_seqs": "auto"}}
    config = EngineConfig.model_validate({**base, "parallel": {"device": "auto"}})
    assert config.engine_device() == local_device("auto") == ("cuda" if visible else "cpu")
    if visible:  # a GPU's seats, whatever this CPU is
        assert config.resolved().scheduler.max_num_seqs == AUTO_MAX_NUM_SEQS["cuda"]
    pinned = EngineConfig.model_validate({**base, "parallel": {"device": "cpu"}})
    assert pinned.engine_device() == "cpu"
