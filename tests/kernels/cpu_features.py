"""What this CPU offers the native kernels (read from /proc/cpuinfo, independently of the
kernels' own checks)."""

from __future__ import annotations

import pathlib


def cpu_flags() -> list[str]:
    """This machine's CPU feature flags (empty where /proc/cpuinfo does not exist)."""
    cpuinfo = pathlib.Path("/proc/cpuinfo")
    text = cpuinfo.read_text() if cpuinfo.exists() else ""
    return next((line.split() for line in text.splitlines() if line.startswith("flags")), [])


def cpu_has_avx512() -> bool:
    """AVX-512 F and BW, what the native kernels need."""
    return "avx512f" in cpu_flags() and "avx512bw" in cpu_flags()
