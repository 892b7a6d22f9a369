"""What a quantized KV cache buys at a fixed KV byte budget: concurrent sequences and decode
throughput, per model shape, context length and KV mode.

`python -m benchmarks.kv_capacity --json [--kv-cache-mib 1024] [--steps 3]` builds one in-process
rank per (shape, mode) at `kv_cache_bytes` = the budget, and for each context length (2k, 8k):

- `max_sequences`: how many sequences of that context the allocated pool holds (its real block
  count, scales counted, over the blocks one sequence needs);
- `decode_tok_s`: decode tokens/s with that many sequences decoding at that context, the median
  of `--steps` steps after one that registers the tables (the context's KV is whatever the pool
  holds: attention reads every block either way, and timing does not depend on values).

Shapes: `smollm2` (the shipped GGUF model), `mistral` (a random model with Mistral-7B's
attention: 32 query heads, 8 KV heads of 128, two layers) and `gemma3` (Gemma-3-4B's: 8 query
heads, 4 KV heads of 256, five sliding-window layers of 1024 and one global). Modes: `full_bf16`
(the model and its KV in bfloat16) and `int8` (the same model, KV as int8 codes with scales:
`kv_cache_dtype="int8"`); the hybrid sliding-window modes are reported as missing until built.
JSON keys are `<shape>_<context>.<figure>`, e.g. `gemma3_8k.int8_over_full_bf16` (sequences).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

from workers import SamplingSettings, SequenceWork, StepPlan, WorkerConfig, WorkerGroup

CONTEXTS = {"2k": 2048, "8k": 8192}
MODES = {"full_bf16": "auto", "int8": "int8"}
MISSING_MODES = ("hybrid_bf16", "hybrid_int8")
"""Hybrid sliding-window block groups (a sliding layer group frees blocks past its window)."""
GREEDY = SamplingSettings(temperature=0.0)
BLOCK_SIZE = 16

SHAPES: dict[str, dict[str, Any]] = {
    "mistral": {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "hidden_size": 512,
        "intermediate_size": 1024,
        "num_hidden_layers": 2,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "sliding_window": None,
    },
    "gemma3": {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 6,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "sliding_window": 1024,
        "query_pre_attn_scalar": 256,
    },
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="benchmarks.kv_capacity", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--json", action="store_true", help="JSON on stdout, the table on stderr")
    parser.add_argument("--kv-cache-mib", type=float, default=1024.0, help="per mode and shape")
    parser.add_argument("--steps", type=int, default=3, help="timed decode steps per point")
    parser.add_argument(
        "--shapes", default="smollm2,mistral,gemma3", help="comma-separated subset of shapes"
    )
    parser.add_argument(
        "--max-timed-sequences",
        type=int,
        default=None,
        help="time at most this many sequences (default: the pool's maximum)",
    )
    return parser.parse_args(argv)


def _write_random(shape: str, directory: pathlib.Path) -> str:
    """A seeded random HF checkpoint with the attention geometry of `shape`."""
    import transformers

    config = dict(SHAPES[shape])
    architecture = config.pop("architectures")[0]
    config.pop("model_type")
    common = {"vocab_size": 512, "max_position_embeddings": 16384, "rope_theta": 10000.0}
    if shape == "gemma3":
        layer_types = ["sliding_attention"] * 5 + ["full_attention"]
        model_config = transformers.Gemma3TextConfig(**common, **config, layer_types=layer_types)
    else:
        model_config = transformers.MistralConfig(**common, **config)
    torch.manual_seed(0)
    model = getattr(transformers, architecture)(model_config).to(torch.bfloat16).eval()
    path = directory / shape
    model.save_pretrained(path)
    return str(path)


def _decode_seconds(group: WorkerGroup, sequences: int, context: int, steps: int) -> list[float]:
    """Each step's seconds with `sequences` sequences decoding at position `context - 1` on."""
    blocks = -(-(context + steps + 1) // BLOCK_SIZE)
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(sequences)]
    first = [
        SequenceWork(i, [42], context - 1, 0, tables[i], 1, sampling=GREEDY)
        for i in range(sequences)
    ]
    group.execute(StepPlan(0, first))
    seconds = []
    for k in range(steps):
        works = [SequenceWork(i, [42], context + k, blocks, [], 1) for i in range(sequences)]
        began = time.perf_counter()
        group.execute(StepPlan(k + 1, works))
        seconds.append(time.perf_counter() - began)
    group.execute(StepPlan(steps + 1, [], released=list(range(sequences))))
    return seconds


def measure_mode(
    model: str, kv_cache_dtype: str, args: argparse.Namespace
) -> dict[str, dict[str, Any]]:
    """{context name: figures} for one model and KV mode."""
    group = WorkerGroup(
        WorkerConfig(
            model=model,
            dtype="bfloat16",
            kv_cache_dtype=kv_cache_dtype,
            backend="local",
            block_size=BLOCK_SIZE,
            kv_cache_bytes=int(args.kv_cache_mib * 2**20),
            swap_space_bytes=0,
        )
    )
    try:
        info = group.model_info
        figures: dict[str, dict[str, Any]] = {}
        for name, wanted in CONTEXTS.items():
            context = min(wanted, info.max_model_len - args.steps - 1)
            per_sequence = -(-(context + args.steps + 1) // BLOCK_SIZE)
            sequences = group.num_device_blocks // per_sequence
            timed = sequences
            if args.max_timed_sequences is not None:
                timed = min(timed, args.max_timed_sequences)
            point: dict[str, Any] = {
                "context": context,
                "kv_blocks": group.num_device_blocks,
                "kv_bytes_per_block": info.kv_bytes_per_block,
                "max_sequences": sequences,
                "timed_sequences": timed,
            }
            if timed > 0:
                seconds = _decode_seconds(group, timed, context, args.steps)
                point["decode_step_s"] = round(statistics.median(seconds), 4)
                point["decode_tok_s"] = round(timed / statistics.median(seconds), 2)
            figures[name] = point
        return figures
    finally:
        group.shutdown()


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 3)


def run(args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {
        "device": "cpu",
        "threads": torch.get_num_threads(),
        "kv_budget_bytes": int(args.kv_cache_mib * 2**20),
        "block_size": BLOCK_SIZE,
        "model_dtype": "bfloat16",
    }
    with tempfile.TemporaryDirectory() as scratch:
        for shape in args.shapes.split(","):
            model = "default" if shape == "smollm2" else _write_random(shape, pathlib.Path(scratch))
            by_mode = {mode: measure_mode(model, kv, args) for mode, kv in MODES.items()}
            for context in CONTEXTS:
                key = f"{shape}_{context}"
                full, int8 = by_mode["full_bf16"][context], by_mode["int8"][context]
                entry: dict[str, Any] = {mode: by_mode[mode][context] for mode in MODES}
                for mode in MISSING_MODES:
                    entry[mode] = {"status": "missing: hybrid block groups are not built"}
                entry["int8_over_full_bf16"] = _ratio(int8["max_sequences"], full["max_sequences"])
                entry["int8_over_full_bf16_blocks"] = _ratio(int8["kv_blocks"], full["kv_blocks"])
                entry["int8_over_full_bf16_decode_tok_s"] = _ratio(
                    int8.get("decode_tok_s"), full.get("decode_tok_s")
                )
                report[key] = entry
                print(
                    f"{key:<12} seqs bf16 {full['max_sequences']:>4} int8 "
                    f"{int8['max_sequences']:>4} ({entry['int8_over_full_bf16']}x)  tok/s bf16 "
                    f"{full.get('decode_tok_s')} int8 {int8.get('decode_tok_s')}",
                    file=sys.stderr,
                )
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    print(json.dumps(report, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
