"""The x86 CPU features the precision defaults and native kernels depend on, read once.

`CpuFeatures.detect()` reads the running CPU (Linux `/proc/cpuinfo` vendor and flags through
`CpuFeatures.from_cpuinfo`; torch's own checks where there is none). `auto_dtype` and
`auto_quantized_activations` are the one rule behind `dtype: auto`:

- bfloat16 where its products are native and faster than float32: CUDA; AMX-BF16 (oneDNN's
  tiles ran 1.47x float32 with int8 products end to end); AVX512-BF16 on AMD's cores (1.54x
  float32 on Zen 4);
- float32 everywhere else, with the products on a GGUF file's codes taking int8-quantized
  activations where the CPU has AVX2 (`quantized_activations`, 1.8-2x float32's output rate end
  to end): where oneDNN only emulates bfloat16 (Ice Lake, Skylake-SP, AVX2-only CPUs), and on
  Intel cores with AVX512-BF16 but no AMX (Cooper Lake, or a virtual machine that hides AMX),
  where oneDNN's bfloat16 products ran 0.92-0.94x float32.

Tests pass a `CpuFeatures` of another CPU kind (or its /proc/cpuinfo text) to force its path.
`auto_max_num_seqs` is what `scheduler.max_num_seqs: auto` means.
"""

from __future__ import annotations

import functools
import pathlib
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch


@dataclass(frozen=True)
class CpuFeatures:
    """What this CPU executes natively (each flag as Linux names it in /proc/cpuinfo)."""

    avx2: bool = False
    avx512: bool = False  # avx512f and avx512bw: the native kernels' 512-bit code (else AVX2)
    avx512_vnni: bool = False
    avx_vnni: bool = False
    avx512_bf16: bool = False
    amx_bf16: bool = False
    vendor: str = ""  # /proc/cpuinfo's vendor_id: "AuthenticAMD", "GenuineIntel", ...

    @property
    def native_bfloat16(self) -> bool:
        """Whether bfloat16 dot products run in hardware (not emulated through float32)."""
        return self.avx512_bf16 or self.amx_bf16

    @property
    def bfloat16_is_faster(self) -> bool:
        """Whether bfloat16 products beat float32 here: AMX tiles, or AMD's AVX512-BF16."""
        return self.amx_bf16 or (self.avx512_bf16 and self.vendor == "AuthenticAMD")

    @property
    def kind(self) -> str:
        """A short name of the CPU kind, for logs and benchmark reports."""
        if self.amx_bf16:
            return "amx-bf16"
        if self.avx512_bf16:
            return "avx512-bf16"
        if self.avx512:
            return "avx512-vnni" if self.avx512_vnni else "avx512"
        return "avx2" if self.avx2 else "x86-64"

    @staticmethod
    def from_flags(flags: set[str], vendor: str = "") -> CpuFeatures:
        """The features a set of /proc/cpuinfo flag names says the CPU has."""
        return CpuFeatures(
            vendor=vendor,
            avx2="avx2" in flags,
            avx512={"avx512f", "avx512bw"} <= flags,
            avx512_vnni="avx512_vnni" in flags,
            avx_vnni="avx_vnni" in flags,
            avx512_bf16="avx512_bf16" in flags,
            amx_bf16="amx_bf16" in flags,
        )

    @staticmethod
    def from_cpuinfo(text: str) -> CpuFeatures | None:
        """The features Linux's /proc/cpuinfo `text` lists for its first CPU (its `vendor_id` and
        `flags` lines), or None where it lists no flags (another OS, an unusual kernel)."""
        vendor = ""
        for line in text.splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "vendor_id":
                vendor = value.strip()
            elif key.strip() == "flags":
                return CpuFeatures.from_flags(set(value.split()), vendor)
        return None

    @staticmethod
    def detect() -> CpuFeatures:
        """The running CPU's features, read once per process (they cannot change while it
        runs; `dtype: auto`, `max_num_seqs: auto` and config validation all ask)."""
        return _running_cpu()


@functools.cache
def _running_cpu() -> CpuFeatures:
    """`CpuFeatures.detect()`'s one reading of this process's CPU."""
    cpuinfo = pathlib.Path("/proc/cpuinfo")
    listed = CpuFeatures.from_cpuinfo(cpuinfo.read_text()) if cpuinfo.exists() else None
    if listed is not None:
        return listed
    capability = torch.backends.cpu.get_cpu_capability()
    return CpuFeatures(
        avx2=capability in ("AVX2", "AVX512"),
        avx512=capability == "AVX512",
        avx512_bf16=bool(torch.cpu._is_avx512_bf16_supported()),
        amx_bf16=bool(torch.cpu._is_amx_tile_supported()),
    )


def auto_dtype(device: str, features: CpuFeatures | None = None) -> str:
    """The dtype `auto` means on `device` ("cuda" or "cpu"; `features`: the CPU's, detected
    when None): the fastest mode that keeps its tests' rule on that hardware."""
    if device == "cuda":
        return "bfloat16"
    cpu = features if features is not None else CpuFeatures.detect()
    return "bfloat16" if cpu.bfloat16_is_faster else "float32"


def auto_quantized_activations(device: str, features: CpuFeatures | None = None) -> bool:
    """Whether `dtype: auto` on `device` also turns on `quantized_activations`: on a CPU where
    `auto_dtype` is float32 and the int8 kernel runs (AVX2 or better). Where bfloat16 is
    native and faster it stays off (bfloat16 keeps the tighter fast-mode rule and beat OpenVINO
    GenAI without it); on CUDA the mode does not exist."""
    if device == "cuda":
        return False
    cpu = features if features is not None else CpuFeatures.detect()
    return auto_dtype(device, cpu) == "float32" and cpu.avx2


AUTO_MAX_NUM_SEQS: Mapping[str, int] = MappingProxyType({"cuda": 64, "amx": 64, "cpu": 16})
"""What `scheduler.max_num_seqs: auto` means, by where the engine runs: the running sequences
the served burst of natural-text chats drained fastest with, while its TPOT p50 stayed under
llama-server's. On AMX, bfloat16 products
(oneDNN's tiles) keep getting cheaper per row up to 64: 64 drained 1.64x faster than 16 with
TPOT p50 0.60x llama-server's. On other CPUs (AMD Zen 4 with AVX512-BF16; float32 with int8
products on Ice Lake-class and AVX2 CPUs) 32 drained only 1.08-1.11x faster than 16 at 1.7x the
TPOT: 16. CUDA keeps the engine's default, 64 (not measured on a GPU here)."""


def auto_max_num_seqs(device: str, features: CpuFeatures | None = None) -> int:
    """The running sequences `max_num_seqs: auto` means on `device` ("cuda" or "cpu";
    `features`: the CPU's, detected when None): `AUTO_MAX_NUM_SEQS`."""
    if device == "cuda":
        return AUTO_MAX_NUM_SEQS["cuda"]
    cpu = features if features is not None else CpuFeatures.detect()
    return AUTO_MAX_NUM_SEQS["amx" if cpu.amx_bf16 else "cpu"]
