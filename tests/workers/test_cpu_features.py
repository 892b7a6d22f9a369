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

X86 = "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat clflush mmx fxsr sse sse2"
AVX2 = "ssse3 fma cx16 sse4_1 sse4_2 movbe popcnt aes xsave avx f16c rdrand bmi1 avx2 bmi2"
AVX512 = "avx512f avx512dq avx512cd avx512bw avx512vl"
CPUINFO_FLAGS = {
    "zen4": (
        "AuthenticAMD",
        f"{X86} {AVX2} {AVX512} avx512ifma avx512vbmi avx512_bf16 avx512_vnni",
    ),
    "zen5": (
        "AuthenticAMD",
        f"{X86} {AVX2} {AVX512} avx_vnni avx512_bf16 avx512_vnni avx512_vp2intersect movdiri",
    ),
    "sapphire_rapids": (
        "GenuineIntel",
        f"{X86} {AVX2} {AVX512} avx_vnni avx512_bf16 avx512_vnni amx_bf16 avx512_fp16 amx_tile "
        "amx_int8",
    ),
    # the same core as a guest whose hypervisor hides AMX (the Xeon measured at 0.92x float32
    # in bfloat16), and Cooper Lake, AVX512-BF16 without AMX in hardware
    "xeon_amx_hidden": (
        "GenuineIntel",
        f"{X86} {AVX2} {AVX512} avx_vnni avx512_bf16 avx512_vnni avx512_fp16",
    ),
    "cooper_lake": ("GenuineIntel", f"{X86} {AVX2} {AVX512} avx512_vnni avx512_bf16"),
    "ice_lake": ("GenuineIntel", f"{X86} {AVX2} {AVX512} avx512ifma avx512vbmi avx512_vnni"),
    "skylake_sp": ("GenuineIntel", f"{X86} {AVX2} {AVX512}"),
    "alder_lake": ("GenuineIntel", f"{X86} {AVX2} avx_vnni"),
    "zen3": ("AuthenticAMD", f"{X86} {AVX2}"),
    "x86_64_baseline": ("GenuineIntel", X86),
}
"""Each CPU kind's /proc/cpuinfo flags as Linux lists them (abridged), and its vendor."""


def cpuinfo_text(vendor: str, flags: str) -> str:
    """A /proc/cpuinfo of two CPUs as Linux writes it (tab before the colon)."""
    cpu = (
        f"processor\t: {{n}}\nvendor_id\t: {vendor}\ncpu family\t: 25\nmodel name\t: A CPU\n"
        f"flags\t\t: {flags}\nbugs\t\t: spectre_v1\n\n"
    )
    return cpu.format(n=0) + cpu.format(n=1)


@pytest.mark.parametrize(
    ("cpu", "kind", "dtype", "int8", "seats"),
    [
        ("zen4", "avx512-bf16", "bfloat16", False, 16),
        ("zen5", "avx512-bf16", "bfloat16", False, 16),
        ("sapphire_rapids", "amx-bf16", "bfloat16", False, 64),
        ("xeon_amx_hidden", "avx512-bf16", "float32", True, 16),
        ("cooper_lake", "avx512-bf16", "float32", True, 16),
        ("ice_lake", "avx512-vnni", "float32", True, 16),
        ("skylake_sp", "avx512", "float32", True, 16),
        ("alder_lake", "avx2", "float32", True, 16),
        ("zen3", "avx2", "float32", True, 16),
        ("x86_64_baseline", "x86-64", "float32", False, 16),
    ],
)
def test_each_cpu_kind_read_from_its_cpuinfo_gets_its_auto_settings(
    cpu: str, kind: str, dtype: str, int8: bool, seats: int
) -> None:
    """From the text Linux writes to the settings `auto` resolves to, so the vendor and flag
    parsing that tells AMD's AVX512-BF16 from Intel's is exercised for every kind."""
    vendor, flags = CPUINFO_FLAGS[cpu]
    features = CpuFeatures.from_cpuinfo(cpuinfo_text(vendor, flags))
    assert features is not None
    assert features == CpuFeatures.from_flags(set(flags.split()), vendor)
    assert features.vendor == vendor
    assert features.kind == kind
    assert features.native_bfloat16 is (kind in ("amx-bf16", "avx512-bf16"))
    assert (auto_dtype("cpu", features), auto_quantized_activations("cpu", features)) == (
        dtype,
        int8,
    )
    assert auto_max_num_seqs("cpu", features) == seats


def test_cpuinfo_without_flags_reads_as_unknown() -> None:
    assert CpuFeatures.from_cpuinfo("") is None
    assert CpuFeatures.from_cpuinfo("processor\t: 0\nvendor_id\t: GenuineIntel\n") is None


def test_detection_reads_this_machines_cpuinfo() -> None:
    cpuinfo = pathlib.Path("/proc/cpuinfo")
    if cpuinfo.exists():
        assert CpuFeatures.detect() == CpuFeatures.from_cpuinfo(cpuinfo.read_text())


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
    assert config.to_worker_config().max_num_seqs == seats


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
        (SAPPHIRE_RAPIDS, INTEL, ("auto", "auto"), ("bfloat16", False)),
        (
            SAPPHIRE_RAPIDS - {"amx_bf16", "amx_tile", "amx_int8"},
            INTEL,
            ("auto", "auto"),
            ("float32", True),
        ),
        (HASWELL, INTEL, ("auto", "auto"), ("float32", True)),
    ],
    ids=[
        "native-bf16",
        "no-bf16",
        "no-bf16-int8-off",
        "no-bf16-float32",
        "native-bf16-int8-on",
        "amx",
        "avx512-bf16-amx-hidden",
        "avx2-only",
    ],
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
