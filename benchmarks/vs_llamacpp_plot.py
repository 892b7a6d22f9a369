"""Bar chart of `benchmarks.vs_llamacpp`'s figures: both servers, both workloads, four panels."""

from __future__ import annotations

from pathlib import Path
from typing import Any

PANELS: tuple[tuple[str, tuple[str, ...], float], ...] = (
    ("output tok/s", ("output_token_throughput_tps",), 1.0),
    ("TTFT p50 (s)", ("ttft_s", "p50"), 1.0),
    ("TPOT p50 (ms)", ("tpot_s", "p50"), 1e3),
    ("goodput (req/s)", ("goodput_rps",), 1.0),
)


def _value(side: dict[str, Any], workload: str, path: tuple[str, ...]) -> float:
    value: Any = side.get(workload, {})
    for part in path:
        value = value.get(part, {}) if isinstance(value, dict) else {}
    return float(value) if isinstance(value, int | float) else 0.0


def plot(path: Path, ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    """Saves the chart to `path`; needs matplotlib (the `bench` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'pagedserve[bench]'") from None
    workloads = ("random", "prefix")
    figure, axes = plt.subplots(1, len(PANELS), figsize=(14, 3.5))
    for axis, (title, keys, scale) in zip(axes, PANELS, strict=True):
        for offset, (label, side) in enumerate((("llama.cpp", theirs), ("pagedserve", ours))):
            xs = [i + 0.4 * offset for i in range(len(workloads))]
            values = [_value(side, w, keys) * scale for w in workloads]
            axis.bar(xs, values, width=0.4, label=label)
        axis.set_xticks([i + 0.2 for i in range(len(workloads))], workloads)
        axis.set_title(title)
    axes[0].legend()
    figure.tight_layout()
    figure.savefig(path)
