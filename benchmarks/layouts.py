"""Paged vs contiguous vs virtual KV layouts on one runtime, at the same KV byte budget.

`python -m benchmarks.layouts --json [--model PATH] [--plot DIR]` (or `pagedserve bench layouts`)
runs one seeded workload (mixed lengths with a long tail, plus a shared-prefix variant; see
`layouts_run`) through the engine under each `cache.kv_layout`, in one process, one after the
other, with the same model, scheduler settings and byte budget, then paged at block sizes 8, 16
and 32 (waste vs kernel time). It prints a table (stderr with --json) and one JSON object: per
run the figures of `layouts_run._summarize`, and ratios against paged, among them
`paged_over_contiguous_peak_concurrency`. Without `--model` a seeded tiny random Llama is written
to a temporary directory (the figures that matter here are memory and scheduling, which depend
on lengths, not on weights).

The model runs in `--dtype` (float32 unless given), never `auto`: the KV budget is in bytes, and
`auto` (bfloat16 on CPUs with native bfloat16) would halve the bytes of a token on some machines
and not others, so the same command would compare layouts at twice the tokens there. With twice
the tokens, contiguous fits twice the sequences while paged stays at `max_num_seqs`, and the
ratio measures the cap, not paging. `paged_capped_by_max_num_seqs` says when paged's peak is the
cap (its ratio is then a lower bound).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
from typing import Any

import torch

from benchmarks.layouts_run import RunResult, Workload, make_workload, run_layout
from cluster.engine.config import EngineConfig

LAYOUTS = ("paged", "contiguous", "virtual")
BLOCK_SIZES = (8, 16, 32)
TABLE_COLUMNS = (
    ("peak_concurrent_sequences", "peak seqs"),
    ("output_tokens_per_s", "tok/s"),
    ("ttft_p50_s", "TTFT p50"),
    ("ttft_p99_s", "TTFT p99"),
    ("tpot_p50_s", "TPOT p50"),
    ("tpot_p99_s", "TPOT p99"),
    ("goodput_req_per_s", "goodput"),
    ("waste_pct", "waste %"),
    ("internal_fragmentation_pct", "int.frag %"),
    ("reservation_waste_pct", "resv.waste %"),
    ("page_faults", "faults"),
    ("preemptions", "preempt"),
    ("forward_seconds", "fwd s"),
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="benchmarks.layouts", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="JSON on stdout, the table on stderr")
    parser.add_argument("--model", default=None, help="model path (default: a tiny random Llama)")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-cache-mib", type=float, default=2.0, help="the same for every layout")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--max-tokens-cap", type=int, default=256, help="clients' max_tokens")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="the model's (and KV's) dtype: one byte budget, the same tokens on every CPU",
    )
    parser.add_argument("--shared-prefix", type=int, default=128, help="tokens, variant 2")
    parser.add_argument("--slo-ttft-s", type=float, default=5.0)
    parser.add_argument("--slo-tpot-s", type=float, default=0.25)
    parser.add_argument("--plot", type=pathlib.Path, default=None, help="directory for figures")
    parser.add_argument("--skip-block-sizes", action="store_true")
    return parser.parse_args(argv)


def base_config(args: argparse.Namespace, model: str) -> EngineConfig:
    return EngineConfig.build(
        {
            "model": {"model": model, "max_model_len": args.max_model_len, "dtype": args.dtype},
            "cache": {
                "kv_cache_bytes": int(args.kv_cache_mib * 2**20),
                "watermark": 0.0,
                "swap_space_bytes": 0,
            },
            "parallel": {"backend": "local"},
            "scheduler": {
                "max_num_seqs": args.max_num_seqs,
                "max_num_batched_tokens": 512,
                "preemption_mode": "recompute",
            },
        }
    )


def _ratios(run: dict[str, Any], paged: dict[str, Any]) -> dict[str, float | None]:
    def ratio(key: str) -> float | None:
        a, b = run.get(key), paged.get(key)
        return None if a is None or not b else round(a / b, 3)

    return {
        "throughput_vs_paged": ratio("output_tokens_per_s"),
        "peak_concurrency_vs_paged": ratio("peak_concurrent_sequences"),
        "ttft_p50_vs_paged": ratio("ttft_p50_s"),
        "tpot_p50_vs_paged": ratio("tpot_p50_s"),
        "goodput_vs_paged": ratio("goodput_req_per_s"),
    }


def workload_report(results: list[RunResult], max_num_seqs: int) -> dict[str, Any]:
    runs = {r.layout: r.metrics for r in results}
    paged = runs["paged"]
    report: dict[str, Any] = {"runs": runs}
    for layout in LAYOUTS[1:]:
        runs[layout]["ratios"] = _ratios(runs[layout], paged)
    contiguous_peak = runs["contiguous"]["peak_concurrent_sequences"]
    report["paged_over_contiguous_peak_concurrency"] = round(
        paged["peak_concurrent_sequences"] / max(contiguous_peak, 1), 3
    )
    report["paged_capped_by_max_num_seqs"] = paged["peak_concurrent_sequences"] >= max_num_seqs
    report["kv_utilization"] = paged["kv_utilization"]
    report["virtual_throughput_vs_paged"] = runs["virtual"]["ratios"]["throughput_vs_paged"]
    return report


def format_table(title: str, results: list[RunResult]) -> str:
    header = f"{'run':<14}" + "".join(f"{label:>13}" for _, label in TABLE_COLUMNS)
    lines = [title, header]
    for r in results:
        name = f"{r.layout}/{r.block_size}"
        cells = "".join(f"{_cell(r.metrics.get(key)):>13}" for key, _ in TABLE_COLUMNS)
        lines.append(f"{name:<14}{cells}")
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def save_plots(directory: pathlib.Path, results: dict[str, list[RunResult]]) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise SystemExit(f"--plot needs matplotlib (pip install -e '.[bench]'): {error}") from None
    directory.mkdir(parents=True, exist_ok=True)
    saved = []
    for name, runs in results.items():
        figure, (memory, cdf) = plt.subplots(1, 2, figsize=(12, 4.5))
        for r in runs:
            line = memory.plot(
                r.timeline["time_s"], r.timeline["backed_mib"], label=f"{r.layout} backed"
            )
            memory.plot(
                r.timeline["time_s"],
                r.timeline["live_mib"],
                linestyle=":",
                color=line[0].get_color(),
                label=f"{r.layout} live",
            )
            ttft = sorted(r.ttft)
            cdf.step(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], label=r.layout)
        memory.set(xlabel="time (s)", ylabel="KV memory (MiB)", title=f"{name}: backed vs live")
        cdf.set(xlabel="TTFT (s)", ylabel="fraction of requests", title=f"{name}: TTFT CDF")
        memory.legend(fontsize=7)
        cdf.legend()
        path = directory / f"layouts_{name}.png"
        figure.tight_layout()
        figure.savefig(path, dpi=120)
        plt.close(figure)
        saved.append(str(path))
    return saved


def _tiny_model(directory: pathlib.Path) -> str:
    from benchmarks.tiny_models import make_tiny_llama

    return str(make_tiny_llama(directory / "tiny_llama"))


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as scratch:
        model = args.model or _tiny_model(pathlib.Path(scratch))
        base = base_config(args, model)
        slo = {"slo_ttft_s": args.slo_ttft_s, "slo_tpot_s": args.slo_tpot_s}
        workloads: list[Workload] = [
            make_workload(
                args.requests,
                args.seed,
                max_model_len=args.max_model_len,
                max_tokens_cap=args.max_tokens_cap,
            ),
            make_workload(
                args.requests,
                args.seed,
                max_model_len=args.max_model_len,
                max_tokens_cap=args.max_tokens_cap,
                shared_prefix=args.shared_prefix,
            ),
        ]
        results: dict[str, list[RunResult]] = {}
        for workload in workloads:
            results[workload.name] = [
                run_layout(base, workload, layout, 16, **slo) for layout in LAYOUTS
            ]
            print(format_table(f"== {workload.name} ==", results[workload.name]), file=sys.stderr)
        block_runs = []
        if not args.skip_block_sizes:
            for size in BLOCK_SIZES:
                block_runs.append(run_layout(base, workloads[0], "paged", size, **slo))
            print(format_table("== paged block sizes (mixed) ==", block_runs), file=sys.stderr)
    mixed = workload_report(results["mixed"], args.max_num_seqs)
    report: dict[str, Any] = {
        "model": args.model or "tiny random Llama (tests/tiny_model.py)",
        "device": "cpu",
        "threads": torch.get_num_threads(),
        "kv_budget_bytes": int(args.kv_cache_mib * 2**20),
        "requests": args.requests,
        "arrival": "all at once (scheduling is timing-independent; times are this machine's)",
        "slo": {"ttft_s": args.slo_ttft_s, "tpot_s": args.slo_tpot_s},
        "dtype": args.dtype,
        "paged_over_contiguous_peak_concurrency": mixed["paged_over_contiguous_peak_concurrency"],
        "paged_capped_by_max_num_seqs": mixed["paged_capped_by_max_num_seqs"],
        "kv_utilization": mixed["kv_utilization"],
        "virtual_throughput_vs_paged": mixed["virtual_throughput_vs_paged"],
        "mixed": mixed,
        "shared_prefix": workload_report(results["shared_prefix"], args.max_num_seqs),
        "block_sizes": {
            str(r.block_size): {
                key: r.metrics[key]
                for key in (
                    "waste_pct",
                    "kv_utilization",
                    "forward_seconds",
                    "output_tokens_per_s",
                    "peak_concurrent_sequences",
                    "preemptions",
                )
            }
            for r in block_runs
        },
    }
    if args.plot is not None:
        report["plots"] = save_plots(args.plot, results)
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise SystemExit("--plot needs matplotlib (pip install -e '.[bench]')") from None
    report = run(args)
    print(json.dumps(report, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
