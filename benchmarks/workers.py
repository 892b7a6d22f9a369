"""Workers benchmark: our paged SmolLM2 against HF transformers' forward, plus Ray call overhead.

`python -m benchmarks.workers --json` prints one JSON object:
- prefill and decode tokens/s at batch 1, 8 and 32 for both, measured in the same run on the same
  shapes (prompt of `--prompt-len` tokens per sequence; decode with that much context, HF using
  its own KV cache), interleaved and best of `--repeats` after a warm-up, and `ratio` = ours / HF;
- with `--compare-dtypes float32,bfloat16`: our decode and prefill tokens/s in each dtype on the
  same shapes (`--compare-batches`, context `--prompt-len`), one dtype after the other (one live
  group at a time, see `dtype_comparison`), best of `--repeats`, and each dtype's ratio over the
  first (`dtype_comparison`), then the rest is skipped;
- the Ray call overhead per step in microseconds: round trip of `WorkerGroup.execute` through one
  Ray actor minus the time the rank spent on the step, for an empty plan and a batch-8 decode;
- `families`: prefill and decode tokens/s of every model family beyond Llama's on a tiny random
  model, at batch 1 and 16 (`benchmarks.families`); `--families-only` prints just those.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import transformers

from benchmarks.families import family_throughput
from workers import SamplingSettings, SequenceWork, StepPlan, WorkerConfig, WorkerGroup
from workers.model_source import resolve_model_path

BATCHES = (1, 8, 32)
GREEDY = SamplingSettings(temperature=0.0)


def _seconds(run: Callable[[], object]) -> float:
    began = time.perf_counter()
    run()
    return time.perf_counter() - began


def local_group(blocks: int, dtype: str = "float32") -> WorkerGroup:
    """An in-process group of SmolLM2 with `blocks` KV blocks, whose rank runs the caller's
    torch thread count."""
    config = WorkerConfig(
        backend="local",
        dtype=dtype,
        num_device_blocks=blocks,
        num_cpu_blocks=1,
        num_threads=torch.get_num_threads(),
    )
    return WorkerGroup(config)


class OurRunner:
    """Prefill and decode steps of `batch` sequences on a local `WorkerGroup`."""

    def __init__(
        self, group: WorkerGroup, batch: int, prompt_len: int, blocks_per_seq: int
    ) -> None:
        self.group = group
        self.batch = batch
        self.prompt_len = prompt_len
        self.blocks_per_seq = blocks_per_seq
        self.step = 0

    def plan(self, works: list[SequenceWork], released: list[int] | None = None) -> StepPlan:
        self.step += 1
        return StepPlan(self.step, works, released=released or [])

    def prefill(self) -> None:
        works = [
            SequenceWork(
                seq_id=i,
                token_ids=[(7 * i + j) % 40000 + 100 for j in range(self.prompt_len)],
                start_pos=0,
                table_start=0,
                table_blocks=list(range(i * self.blocks_per_seq, (i + 1) * self.blocks_per_seq)),
                num_samples=1,
                sampling=GREEDY,
            )
            for i in range(self.batch)
        ]
        self.group.execute(self.plan(works, released=list(range(self.batch))))

    def decode(self, steps: int) -> None:
        for k in range(steps):
            works = [
                SequenceWork(i, [42], self.prompt_len + k, self.blocks_per_seq, [], 1)
                for i in range(self.batch)
            ]
            self.group.execute(self.plan(works))


def _hf_prefill(model: transformers.PreTrainedModel, ids: torch.Tensor) -> Any:
    """HF's prefill as generation runs it: KV cache on, logits of the last position only."""
    with torch.inference_mode():
        return model(ids, use_cache=True, logits_to_keep=1).past_key_values


def _hf_decode_seconds(model: transformers.PreTrainedModel, ids: torch.Tensor, steps: int) -> float:
    """Wall time of `steps` batched decode steps after a prefill of `ids` (HF's own KV cache)."""
    cache = _hf_prefill(model, ids)
    with torch.inference_mode():
        step_ids = torch.full((ids.shape[0], 1), 42)
        began = time.perf_counter()
        for _ in range(steps):
            model(step_ids, past_key_values=cache, use_cache=True)
        return time.perf_counter() - began


def throughput(
    group: WorkerGroup, hf: transformers.PreTrainedModel, prompt_len: int, steps: int, repeats: int
) -> dict[str, Any]:
    """Prefill and decode tokens/s for both implementations at every batch size. HF runs on our
    rank's thread (a benchmark-only reach into the group): a second thread running torch would
    keep a second OpenMP team alive, and with more OpenMP threads than cores libgomp stops
    spinning at barriers for both sides (a bfloat16 decode step measured 1.6-1.8x slower)."""
    on_rank = group._rank_thread.call
    blocks_per_seq = -(-(prompt_len + steps + 1) // group.config.block_size)
    results: dict[str, Any] = {"prefill": {}, "decode": {}}
    for batch in BATCHES:
        ours = OurRunner(group, batch, prompt_len, blocks_per_seq)
        ids = torch.tensor(
            [[(7 * i + j) % 40000 + 100 for j in range(prompt_len)] for i in range(batch)]
        )
        ours_prefill, hf_prefill, ours_decode, hf_decode = [], [], [], []
        for _ in range(repeats + 1):  # interleaved, so both sides see the same machine load
            ours_prefill.append(_seconds(ours.prefill))
            hf_prefill.append(_seconds(lambda ids=ids: on_rank(_hf_prefill, hf, ids)))
            ours_decode.append(_seconds(lambda ours=ours: ours.decode(steps)))
            hf_decode.append(on_rank(_hf_decode_seconds, hf, ids, steps))
        best = [min(times[1:]) for times in (ours_prefill, hf_prefill, ours_decode, hf_decode)]
        prefill_tokens, decode_tokens = batch * prompt_len, batch * steps
        print(f"batch {batch} done", file=sys.stderr, flush=True)
        results["prefill"][f"batch_{batch}"] = _pair(
            prefill_tokens / best[0], prefill_tokens / best[1]
        )
        results["decode"][f"batch_{batch}"] = _pair(
            decode_tokens / best[2], decode_tokens / best[3]
        )
    return results


def _pair(ours: float, hf: float) -> dict[str, float]:
    return {
        "ours_tokens_per_s": round(ours, 1),
        "hf_tokens_per_s": round(hf, 1),
        "ratio": round(ours / hf, 3),
    }


def dtype_comparison(
    dtypes: list[str], batches: list[int], prompt_len: int, steps: int, repeats: int
) -> dict[str, Any]:
    """Our prefill and decode tokens/s per dtype on the same shapes; `ratio` is each dtype's
    tokens/s over the first dtype's. One dtype's group at a time (shut down before the next):
    two live groups keep two rank threads with an OpenMP team each, and with more OpenMP threads
    than cores libgomp stops spinning at barriers for both, which slows both."""
    blocks_per_seq = -(-(prompt_len + steps + 1) // 16)
    blocks = max(batches) * blocks_per_seq + 8
    times: dict[tuple[int, str], dict[str, list[float]]] = {}
    for dtype in dtypes:
        group = local_group(blocks, dtype)
        try:
            for batch in batches:
                runner = OurRunner(group, batch, prompt_len, blocks_per_seq)
                phases: dict[str, list[float]] = {"prefill": [], "decode": []}
                for _ in range(repeats + 1):
                    phases["prefill"].append(_seconds(runner.prefill))
                    phases["decode"].append(_seconds(lambda r=runner: r.decode(steps)))
                times[(batch, dtype)] = phases
        finally:
            group.shutdown()
    results: dict[str, Any] = {}
    for batch in batches:
        row: dict[str, Any] = {}
        for phase, tokens in (("prefill", batch * prompt_len), ("decode", batch * steps)):
            rates = {d: tokens / min(times[(batch, d)][phase][1:]) for d in dtypes}
            row[phase] = {
                **{f"{d}_tokens_per_s": round(r, 1) for d, r in rates.items()},
                **{f"{d}_ratio": round(rates[d] / rates[dtypes[0]], 3) for d in dtypes[1:]},
            }
        results[f"batch_{batch}"] = row
    return results


def ray_overhead(calls: int) -> dict[str, float]:
    """Mean per-step Ray call overhead (us) through one actor: empty plan and batch-8 decode."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    group = WorkerGroup(
        WorkerConfig(dtype="float32", backend="ray", num_device_blocks=40, num_cpu_blocks=1)
    )
    try:
        runner = OurRunner(group, 8, 16, 4)
        for _ in range(5):
            group.execute(runner.plan([]))
        empty = []
        for _ in range(calls):
            group.execute(runner.plan([]))
            empty.append(group.overhead.last)
        runner.prefill()
        runner.prefill()
        decode = []
        for k in range(min(calls, 40)):
            works = [SequenceWork(i, [42], 16 + k, 4, [], 1) for i in range(8)]
            group.execute(runner.plan(works))
            decode.append(group.overhead.last)
        return {
            "empty_step_mean_us": round(statistics.mean(empty) * 1e6, 1),
            "empty_step_median_us": round(statistics.median(empty) * 1e6, 1),
            "decode_batch8_step_mean_us": round(statistics.mean(decode) * 1e6, 1),
            "decode_batch8_step_median_us": round(statistics.median(decode) * 1e6, 1),
        }
    finally:
        group.shutdown()
        ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--decode-steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ray-calls", type=int, default=100)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--compare-dtypes", help="e.g. float32,bfloat16: only compare these")
    parser.add_argument("--compare-batches", default="1,16,32")
    parser.add_argument("--families-only", action="store_true", help="only the family figures")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.compare_dtypes:
        comparison = dtype_comparison(
            args.compare_dtypes.split(","),
            [int(b) for b in args.compare_batches.split(",")],
            args.prompt_len,
            args.decode_steps,
            args.repeats,
        )
        report = {"torch_threads": torch.get_num_threads(), "prompt_len": args.prompt_len}
        report["dtype_comparison"] = comparison
        print(json.dumps(report, indent=None if args.json else 2))
        return
    families = family_throughput(args.prompt_len, args.decode_steps, args.repeats)
    if args.families_only:
        report = {"torch_threads": torch.get_num_threads(), "prompt_len": args.prompt_len}
        report["families"] = families
        print(json.dumps(report, indent=None if args.json else 2))
        return
    blocks = 32 * -(-(args.prompt_len + args.decode_steps + 1) // 16) + 8
    group = local_group(blocks)
    path = resolve_model_path("default")
    hf = group._rank_thread.call(  # on the rank's thread, as every HF call below
        lambda: transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        ).eval()
    )
    report: dict[str, Any] = {
        "model": "SmolLM2-135M-Instruct (GGUF Q4_1, dequantized to float32)",
        "device": "cpu",
        "torch_threads": torch.get_num_threads(),
        "prompt_len": args.prompt_len,
        "decode_steps": args.decode_steps,
    }
    report.update(throughput(group, hf, args.prompt_len, args.decode_steps, args.repeats))
    group.shutdown()
    del hf
    report["ray_call_overhead"] = ray_overhead(args.ray_calls)
    report["families"] = families
    print(json.dumps(report, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
