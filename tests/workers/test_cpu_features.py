"""`dtype: auto` per CPU kind (the dtype and whether products take int8 activations), with each
kind forced through the detection function, and the group resolving it before any rank sees
it."""

from __future__ import annotations

import pathlib

import pytest
import torch

from cluster.engine.config import EngineConfig
from workers import WorkerConfig, WorkerGroup
from workers.cpu_features import (
    CpuFeatures,
    auto_dtype,
    auto_max_num_seqs,
    auto_quantized_activations,
)

EPYC_GENOA = {"avx2", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx_vnni"}
ICE_LAKE = {"avx2", "avx512f", "avx512bw", "avx512_vnni"}
SAPPHIRE_RAPIDS = ICE_LAKE | {"avx512_bf16", "amx_bf16", "amx_tile", "amx_int8"}
HASWELL = {"avx2", "fma"}
AMD, INTEL = "AuthenticAMD", "GenuineIntel"


@pytest.mark.parametrize(
    ("flags", "vendor", "kind", "dtype", "int8"),
    [
        (EPYC_GENOA, AMD, "avx512-bf16", "bfloat16", False),
        (SAPPHIRE_RAPIDS, INTEL, "amx-bf16", "bfloat16", False),
        # Cooper Lake, or a Sapphire Rapids guest whose hypervisor hides AMX: native bfloat16
        # dot products that ran slower than float32
        (
            SAPPHIRE_RAPIDS - {"amx_bf16", "amx_tile", "amx_int8"},
            INTEL,
            "avx512-bf16",
            "float32",
            True,
        ),
        (EPYC_GENOA, "", "avx512-bf16", "float32", True),  # vendor unknown: not bfloat16
        (ICE_LAKE, INTEL, "avx512-vnni", "float32", True),
        (HASWELL, INTEL, "avx2", "float32", True),
        (set(), "", "x86-64", "float32", False),  # the int8 kernel needs AVX2
    ],
)
def test_auto_is_bfloat16_only_where_it_is_native_and_faster(
    flags: set[str], vendor: str, kind: str, dtype: str, int8: bool
) -> None:
    features = CpuFeatures.from_flags(flags, vendor)
    assert features.kind == kind
    assert auto_dtype("cpu", features) == dtype
    assert auto_quantized_activations("cpu", features) is int8
    assert auto_dtype("cuda", features) == "bfloat16"
    assert auto_quantized_activations("cuda", features) is False


@pytest.mark.parametrize(
    ("flags", "vendor", "seats"),
    [
        (SAPPHIRE_RAPIDS, INTEL, 64),
        (SAPPHIRE_RAPIDS - {"amx_bf16", "amx_tile", "amx_int8"}, INTEL, 16),
        (EPYC_GENOA, AMD, 16),
        (ICE_LAKE, INTEL, 16),
        (HASWELL, INTEL, 16),
        (set(), "", 16),
    ],
)
def test_auto_running_sequences_per_cpu_kind(flags: set[str], vendor: str, seats: int) -> None:
    features = CpuFeatures.from_flags(flags, vendor)
    assert auto_max_num_seqs("cpu", features) == seats
    assert auto_max_num_seqs("cuda", features) == 64


@pytest.mark.parametrize(
    ("flags", "vendor", "budget", "seats"),
    [
        (SAPPHIRE_RAPIDS, INTEL, 256, 64),
        (SAPPHIRE_RAPIDS, INTEL, 48, 48),
        (ICE_LAKE, INTEL, 256, 16),
    ],
    ids=["amx", "amx-budget-caps-it", "ice-lake"],
)
def test_the_engine_config_resolves_auto_running_sequences_for_this_cpu(
    monkeypatch: pytest.MonkeyPatch, flags: set[str], vendor: str, budget: int, seats: int
) -> None:
    """Forced through the detection function, as the engine's process resolves it."""
    detected = CpuFeatures.from_flags(flags, vendor)
    monkeypatch.setattr(CpuFeatures, "detect", staticmethod(lambda: detected))
    scheduler = {"max_num_seqs": "auto", "max_num_batched_tokens": budget}
    config = EngineConfig.build({"parallel": {"device": "cpu"}, "scheduler": scheduler})
    assert config.scheduler.max_num_seqs == "auto"
    resolved = config.resolved()
    assert resolved.scheduler.max_num_seqs == seats
    assert resolved.resolved() is resolved
    assert config.to_worker_config().kv_virtual_slots == seats


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
    ("flags", "vendor", "asked", "expected"),
    [
        (EPYC_GENOA, AMD, ("auto", "auto"), ("bfloat16", False)),
        (ICE_LAKE, INTEL, ("auto", "auto"), ("float32", True)),
        (ICE_LAKE, INTEL, ("auto", False), ("float32", False)),
        (ICE_LAKE, INTEL, ("float32", "auto"), ("float32", False)),  # the exact mode, asked for
        (EPYC_GENOA, AMD, ("auto", True), ("bfloat16", True)),
    ],
    ids=["native-bf16", "no-bf16", "no-bf16-int8-off", "no-bf16-float32", "native-bf16-int8-on"],
)
def test_group_resolves_auto_before_the_rank_loads(
    tiny_model_dir: pathlib.Path,
    monkeypatch: pytest.MonkeyPatch,
    flags: set[str],
    vendor: str,
    asked: tuple[str, str | bool],
    expected: tuple[str, bool],
) -> None:
    forced = CpuFeatures.from_flags(flags, vendor)
    monkeypatch.setattr(CpuFeatures, "detect", staticmethod(lambda: forced))
    dtype, quantized = asked
    group = WorkerGroup(
        WorkerConfig(
            model=str(tiny_model_dir),
            dtype=dtype,
            quantized_activations=quantized,
            backend="local",
            num_device_blocks=8,
        )
    )
    try:
        assert (group.config.dtype, group.config.quantized_activations) == expected
        info = group.model_info  # what the cache keys and APIs report
        assert (info.dtype, info.quantized_activations) == expected
        assert group._local is not None
        assert group._local.device_pool.dtype == getattr(torch, expected[0])
        assert group._local.model.quantized_activations is expected[1]
    finally:
        group.shutdown()


def test_int8_products_are_in_the_cache_identity(
    tiny_model_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blocks computed with int8 products never serve a request of an engine without them (a
    peer pull, the CPU tier): the two modes' KV values differ."""
    from pagedserve import LLM, SamplingParams

    forced = CpuFeatures.from_flags(ICE_LAKE, INTEL)
    monkeypatch.setattr(CpuFeatures, "detect", staticmethod(lambda: forced))
    hashes = []
    for quantized in (True, False):
        with LLM(
            model=str(tiny_model_dir),
            backend="local",
            num_device_blocks=16,
            quantized_activations=quantized,
        ) as llm:
            prompt = {"prompt_token_ids": list(range(40))}
            request = llm.engine.request_builder.build(prompt, SamplingParams(max_tokens=1))
            hashes.append(llm.engine.request_keys.block_hashes(request))
    assert hashes[0] and hashes[1]
    assert set(hashes[0]).isdisjoint(hashes[1])


@pytest.mark.parametrize(
    ("flags", "vendor", "seats"), [(SAPPHIRE_RAPIDS, INTEL, 64), (ICE_LAKE, INTEL, 16)]
)
def test_the_engine_admits_as_many_running_sequences_as_auto_resolves_to(
    tiny_model_dir: pathlib.Path,
    monkeypatch: pytest.MonkeyPatch,
    flags: set[str],
    vendor: str,
    seats: int,
) -> None:
    """`LLM` (the engine core) resolves "auto" before it builds anything, and its scheduler
    then runs that many sequences at once and no more."""
    from cluster.engine.llm import LLM
    from cluster.engine.sampling_params import SamplingParams

    forced = CpuFeatures.from_flags(flags, vendor)
    monkeypatch.setattr(CpuFeatures, "detect", staticmethod(lambda: forced))
    with LLM(
        str(tiny_model_dir),
        dtype="float32",
        device="cpu",
        num_device_blocks=512,
        block_size=4,
        max_num_seqs="auto",
        max_num_batched_tokens=256,
    ) as llm:
        assert llm.config.scheduler.max_num_seqs == seats
        engine, greedy = llm.engine, SamplingParams(max_tokens=2, ignore_eos=True)
        for i in range(seats + 8):
            engine.add_request(engine.request_builder.build(f"prompt {i}", greedy))
        engine.step()
        assert len(engine.scheduler.running) == seats
