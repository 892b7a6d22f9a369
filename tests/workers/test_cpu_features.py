"""`dtype: auto` per CPU kind, with each kind forced through the detection function, and the
group resolving it before any rank sees it."""

from __future__ import annotations

import pathlib

import pytest
import torch

from cluster.engine.config import EngineConfig
from workers import WorkerConfig, WorkerGroup
from workers.cpu_features import CpuFeatures, auto_dtype

EPYC_GENOA = {"avx2", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx_vnni"}
ICE_LAKE = {"avx2", "avx512f", "avx512bw", "avx512_vnni"}
SAPPHIRE_RAPIDS = ICE_LAKE | {"avx512_bf16", "amx_bf16", "amx_tile", "amx_int8"}
HASWELL = {"avx2", "fma"}
AMD, INTEL = "AuthenticAMD", "GenuineIntel"


@pytest.mark.parametrize(
    ("flags", "vendor", "kind", "dtype"),
    [
        (EPYC_GENOA, AMD, "avx512-bf16", "bfloat16"),
        (SAPPHIRE_RAPIDS, INTEL, "amx-bf16", "bfloat16"),
        # Cooper Lake, or a Sapphire Rapids guest whose hypervisor hides AMX: native bfloat16
        # dot products that ran slower than float32
        (SAPPHIRE_RAPIDS - {"amx_bf16", "amx_tile", "amx_int8"}, INTEL, "avx512-bf16", "float32"),
        (EPYC_GENOA, "", "avx512-bf16", "float32"),  # vendor unknown: the safe, exact mode
        (ICE_LAKE, INTEL, "avx512-vnni", "float32"),
        (HASWELL, INTEL, "avx2", "float32"),
        (set(), "", "x86-64", "float32"),
    ],
)
def test_auto_is_bfloat16_only_where_it_is_native_and_faster(
    flags: set[str], vendor: str, kind: str, dtype: str
) -> None:
    features = CpuFeatures.from_flags(flags, vendor)
    assert features.kind == kind
    assert auto_dtype("cpu", features) == dtype
    assert auto_dtype("cuda", features) == "bfloat16"


def test_detection_agrees_with_torch() -> None:
    features = CpuFeatures.detect()
    assert features.avx512_bf16 == bool(torch.cpu._is_avx512_bf16_supported())
    assert features.amx_bf16 == bool(torch.cpu._is_amx_tile_supported())
    assert auto_dtype("cpu") == auto_dtype("cpu", features)


def test_auto_is_every_front_door_default() -> None:
    assert EngineConfig().model.dtype == "auto"
    assert EngineConfig().to_worker_config().dtype == "auto"
    with pytest.raises(ValueError, match="resolved by WorkerGroup"):
        _ = WorkerConfig(dtype="auto").torch_dtype


@pytest.mark.parametrize(
    ("flags", "vendor", "expected"),
    [(EPYC_GENOA, AMD, "bfloat16"), (ICE_LAKE, INTEL, "float32")],
    ids=["native-bf16", "no-bf16"],
)
def test_group_resolves_auto_before_the_rank_loads(
    tiny_model_dir: pathlib.Path,
    monkeypatch: pytest.MonkeyPatch,
    flags: set[str],
    vendor: str,
    expected: str,
) -> None:
    forced = CpuFeatures.from_flags(flags, vendor)
    monkeypatch.setattr(CpuFeatures, "detect", staticmethod(lambda: forced))
    assert auto_dtype("cpu", forced) == expected
    group = WorkerGroup(
        WorkerConfig(model=str(tiny_model_dir), dtype="auto", backend="local", num_device_blocks=8)
    )
    try:
        assert group.config.dtype == expected
        assert group.model_info.dtype == expected  # what the cache keys and APIs report
        assert group._local is not None
        assert group._local.device_pool.dtype == getattr(torch, expected)
    finally:
        group.shutdown()
