"""Bad input gets a ValueError naming the problem, before any rank starts where possible."""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest

from workers import (
    SamplingSettings,
    SequenceWork,
    StepPlan,
    WorkerConfig,
    WorkerGroup,
    resolve_model_path,
)


def _copy_model(
    source: pathlib.Path, target: pathlib.Path, **config_changes: object
) -> pathlib.Path:
    """A copy of the tiny model (weights symlinked) with some config.json entries replaced."""
    target.mkdir()
    for path in source.iterdir():
        if path.name != "config.json":
            (target / path.name).symlink_to(path)
    config = json.loads((source / "config.json").read_text())
    config.update(config_changes)
    (target / "config.json").write_text(json.dumps(config))
    return target


def _start(model: pathlib.Path | str, cache: pathlib.Path, **options: object) -> WorkerGroup:
    settings: dict[str, object] = {
        "backend": "local",
        "dtype": "float32",
        "num_device_blocks": 8,
        **options,
    }
    return WorkerGroup(
        WorkerConfig(model=str(model), weights_cache_dir=str(cache), **settings)  # type: ignore[arg-type]
    )


def test_unknown_architecture(tiny_model_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    model = _copy_model(
        tiny_model_dir, tmp_path / "m", architectures=["GPT2LMHeadModel"], model_type="gpt2"
    )
    with pytest.raises(ValueError, match="unknown model architecture 'GPT2LMHeadModel'"):
        _start(model, tmp_path / "cache")


def test_missing_model_path_and_weights(
    tiny_model_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model_path(str(tmp_path / "nowhere"))
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(tiny_model_dir / "config.json", bare / "config.json")
    with pytest.raises(ValueError, match=r"has no \*\.safetensors weights file"):
        _start(bare, tmp_path / "cache")


def test_truncated_weights_files(tiny_model_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    model = _copy_model(tiny_model_dir, tmp_path / "m")
    weights = model / "model.safetensors"
    data = weights.read_bytes()
    weights.unlink()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"model\.safetensors is truncated or corrupt"):
        _start(model, tmp_path / "cache")
    gguf = tmp_path / "cut.gguf"
    gguf.write_bytes(resolve_model_path("default").read_bytes()[:3_000_000])
    with pytest.raises(ValueError, match=r"cut\.gguf is truncated or corrupt"):
        _start(gguf, tmp_path / "cache")


def test_config_weights_shape_mismatch(
    tiny_model_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    model = _copy_model(tiny_model_dir, tmp_path / "m", intermediate_size=128)
    with pytest.raises(
        ValueError,
        match=r"weight 'model.layers.0.mlp.gate_proj.weight' has shape \[256, 128\] but the "
        r"model config expects \[128, 128\]",
    ):
        _start(model, tmp_path / "cache")


def test_tensor_parallel_degree_must_divide_heads(
    tiny_model_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide the model's 4"):
        _start(tiny_model_dir, tmp_path / "cache", backend="ray", tensor_parallel_size=3)
    with pytest.raises(ValueError, match="backend 'local' runs one in-process rank"):
        WorkerConfig(backend="local", tensor_parallel_size=2)


def test_inconsistent_plans(tiny_group: WorkerGroup) -> None:
    with pytest.raises(ValueError, match="sequence 77 needs 2 blocks for 5 tokens"):
        tiny_group.execute(StepPlan(1, [SequenceWork(77, [1, 2, 3, 4, 5], 0, 0, [3])]))
    with pytest.raises(ValueError, match="no sampling settings were ever sent"):
        tiny_group.execute(StepPlan(2, [SequenceWork(78, [1], 0, 0, [3], num_samples=1)]))
    with pytest.raises(ValueError, match="fork of unknown sequence 999"):
        tiny_group.execute(StepPlan(3, forks=[(999, 1000)]))
    with pytest.raises(ValueError, match="splices its block table at 1 but only 0 entries"):
        tiny_group.execute(StepPlan(4, [SequenceWork(77, [1], 4, 1, [5])]))  # 77 was rolled back
    with pytest.raises(ValueError, match=r"token id outside \[0, 49152\)"):
        tiny_group.execute(StepPlan(5, [SequenceWork(79, [49152], 0, 0, [3])]))
    with pytest.raises(ValueError, match=r"block id outside \[0, 96\)"):
        tiny_group.execute(StepPlan(6, [SequenceWork(79, [1], 0, 0, [96])]))
    with pytest.raises(ValueError, match=r"swap_in pair \(16, 0\) is out of range"):
        tiny_group.execute(StepPlan(7, swap_in=[(16, 0)]))
    bad_settings = SamplingSettings(temperature=-1.0)
    with pytest.raises(ValueError, match=r"temperature must be >= 0, got -1\.0"):
        tiny_group.execute(
            StepPlan(9, [SequenceWork(79, [1], 0, 0, [3], 1, sampling=bad_settings)])
        )
    with pytest.raises(ValueError, match=r"copy_pairs pair \(0, -1\) is out of range"):
        tiny_group.execute(StepPlan(8, copy_pairs=[(0, -1)]))
