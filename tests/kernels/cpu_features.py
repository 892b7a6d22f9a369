"""What this CPU offers the native kernels (read from /proc/cpuinfo, independently of the
kernels' own checks)."""

from __future__ import annotations

import pathlib

import pytest


def cpu_flags() -> list[str]:
    """This machine's CPU feature flags (empty where /proc/cpuinfo does not exist)."""
    cpuinfo = pathlib.Path("/proc/cpuinfo")
    text = cpuinfo.read_text() if cpuinfo.exists() else ""
    return next((line.split() for line in text.splitlines() if line.startswith("flags")), [])


def cpu_has_avx2_fma() -> bool:
    """AVX2 and FMA, the least the native vector kernels need."""
    return {"avx2", "fma"} <= set(cpu_flags())


def cpu_vector_isas() -> tuple[str, ...]:
    """The instruction sets of the native vector kernels (`pagedserve_kernels.native.VECTOR_ISAS`)
    this CPU has, fastest first: "avx512" (AVX-512 F and BW besides AVX2 and FMA) and "avx2"."""
    flags = set(cpu_flags())
    if not cpu_has_avx2_fma():
        return ()
    return ("avx512", "avx2") if {"avx512f", "avx512bw"} <= flags else ("avx2",)


needs_vector_kernels = pytest.mark.skipif(
    not cpu_has_avx2_fma(), reason="the native vector kernels need AVX2 and FMA"
)
"""For tests of the native vector kernels: they run wherever the CPU has AVX2 and FMA."""

each_isa = pytest.mark.parametrize("isa", cpu_vector_isas())
"""Runs a test once per instruction set of the native vector kernels this CPU has, so an
AVX-512 machine runs the AVX2 code too."""
