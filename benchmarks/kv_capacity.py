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
(the model and its KV in bfloat16, every layer keeping every block:
`disable_hybrid_kv_cache_manager`), `int8` (the same, KV as int8 codes with scales:
`kv_cache_dtype="int8"`), and `hybrid_bf16` / `hybrid_int8` (hybrid KV groups,
`block_manager.hybrid`: sliding layers hand back the blocks their window has passed). A
shape without sliding-window layers has no hybrid groups: its hybrid modes are its full ones.

Hybrid sequences are counted by the engine's own manager: sequences of `context + steps + 1`
tokens are allocated one after another (each whole prompt in every group, as the engine
admits it) and marked computed up to the decode position, until the next one no longer fits;
the decode steps then run on the manager's tables, each step's tokens marked computed after it.
JSON keys are `<shape>_<context>.<figure>`, e.g. `gemma3_8k.int8_over_full_bf16` (sequences),
`gemma3_8k.hybrid_int8_over_full_bf16`, `gemma3_8k.hybrid_over_full_bf16` and each one's
`..._decode_tok_s` (decode tokens/s at that mode's concurrency over full bf16's).
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

from block_manager import CacheIdentity, CacheKey
from block_manager.hybrid import HybridKVManager
from workers import SamplingSettings, SequenceWork, StepPlan, WorkerConfig, WorkerGroup

CONTEXTS = {"2k": 2048, "8k": 8192}
MODES = {
    "full_bf16": ("auto", False),
    "int8": ("int8", False),
    "hybrid_bf16": ("auto", True),
    "hybrid_int8": ("int8", True),
}
"""Mode -> (kv_cache_dtype, hybrid KV groups)."""
RATIOS = {"int8": "int8", "hybrid_bf16": "hybrid", "hybrid_int8": "hybrid_int8"}
"""Mode -> the name of its ratio over full bf16 (`<name>_over_full_bf16`)."""
GREEDY = SamplingSettings(temperature=0.0)
HYBRID_KEY = CacheKey(
    CacheIdentity(model_weights_digest="kv-capacity", tokenizer_digest="none").digest()
)
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


def _hybrid_manager(group: WorkerGroup) -> HybridKVManager:
    return HybridKVManager(
        windows=group.model_info.kv_group_windows,
        num_device_blocks=group.num_device_blocks,
        num_cpu_blocks=0,
        block_size=BLOCK_SIZE,
        enable_prefix_caching=False,
    )


def _hybrid_fill(manager: HybridKVManager, context: int, steps: int, limit: int | None) -> int:
    """Sequences of `context + steps + 1` tokens admitted one by one (computed up to the
    decode position `context - 1`) until the next does not fit, or `limit` of them."""
    tokens = [42] * (context + steps + 1)
    count = 0
    while limit is None or count < limit:
        if not manager.can_allocate(tokens, HYBRID_KEY):
            break
        manager.allocate(count, tokens, HYBRID_KEY)
        manager.mark_computed(count, context - 1)
        count += 1
    return count


def _hybrid_decode_seconds(
    group: WorkerGroup, manager: HybridKVManager, sequences: int, context: int, steps: int
) -> list[float]:
    """`_decode_seconds` on the hybrid manager's tables: each step's tokens marked computed
    after it, so the sliding groups drop blocks and the next plan carries their deltas."""

    def works(position: int, first: bool) -> list[SequenceWork]:
        planned = []
        for i in range(sequences):
            start, blocks = manager.take_table_delta(i)
            sampling = GREEDY if first else None
            planned.append(SequenceWork(i, [42], position, start, blocks, 1, sampling=sampling))
        return planned

    def computed(position: int) -> None:
        for i in range(sequences):
            manager.mark_computed(i, position + 1)

    group.execute(StepPlan(0, works(context - 1, True)))
    computed(context - 1)
    seconds = []
    for k in range(steps):
        plan = StepPlan(k + 1, works(context + k, False))
        began = time.perf_counter()
        group.execute(plan)
        seconds.append(time.perf_counter() - began)
        computed(context + k)
    group.execute(StepPlan(steps + 1, [], released=list(range(sequences))))
    return seconds


def measure_mode(
    model: str, kv_cache_dtype: str, hybrid: bool, args: argparse.Namespace
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
            disable_hybrid_kv_cache_manager=not hybrid,
        )
    )
    try:
        info = group.model_info
        figures: dict[str, dict[str, Any]] = {}
        for name, wanted in CONTEXTS.items():
            context = min(wanted, info.max_model_len - args.steps - 1)
            per_sequence = -(-(context + args.steps + 1) // BLOCK_SIZE)
            manager = _hybrid_manager(group) if info.kv_group_windows else None
            if manager is None:
                sequences = group.num_device_blocks // per_sequence
            else:
                sequences = _hybrid_fill(manager, context, args.steps, None)
            timed = sequences
            if args.max_timed_sequences is not None:
                timed = min(timed, args.max_timed_sequences)
            point: dict[str, Any] = {
                "context": context,
                "kv_blocks": group.num_device_blocks,
                "kv_bytes_per_block": info.kv_bytes_per_block,
                "kv_groups": len(info.kv_group_windows) or 1,
                "max_sequences": sequences,
                "timed_sequences": timed,
            }
            if timed > 0 and manager is not None:
                manager = _hybrid_manager(group)
                _hybrid_fill(manager, context, args.steps, timed)
                seconds = _hybrid_decode_seconds(group, manager, timed, context, args.steps)
                point["decode_step_s"] = round(statistics.median(seconds), 4)
                point["decode_tok_s"] = round(timed / statistics.median(seconds), 2)
            elif timed > 0:
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
            windowed = shape != "smollm2" and SHAPES[shape]["sliding_window"] is not None
            by_mode: dict[str, dict[str, dict[str, Any]]] = {}
            for mode, (kv, hybrid) in MODES.items():
                if hybrid and not windowed:  # no sliding layers: the same as the full mode
                    by_mode[mode] = by_mode["int8" if kv == "int8" else "full_bf16"]
                    continue
                by_mode[mode] = measure_mode(model, kv, hybrid, args)
            for context in CONTEXTS:
                key = f"{shape}_{context}"
                full = by_mode["full_bf16"][context]
                entry: dict[str, Any] = {mode: by_mode[mode][context] for mode in MODES}
                for mode, name in RATIOS.items():
                    point = by_mode[mode][context]
                    ratio = f"{name}_over_full_bf16"
                    entry[ratio] = _ratio(point["max_sequences"], full["max_sequences"])
                    entry[f"{ratio}_decode_tok_s"] = _ratio(
                        point.get("decode_tok_s"), full.get("decode_tok_s")
                    )
                entry["int8_over_full_bf16_blocks"] = _ratio(
                    by_mode["int8"][context]["kv_blocks"], full["kv_blocks"]
                )
                report[key] = entry
                print(
                    f"{key:<12} seqs "
                    + " ".join(f"{m} {by_mode[m][context]['max_sequences']}" for m in MODES)
                    + "  tok/s "
                    + " ".join(f"{m} {by_mode[m][context].get('decode_tok_s')}" for m in MODES),
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
