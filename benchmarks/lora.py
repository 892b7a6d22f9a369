"""Multi-LoRA decode throughput: one batch of 16 requests with no adapter, one adapter for all,
and the 16 spread over four adapters, side by side in one run.

`python -m benchmarks.lora --json [--rank 16] [--dtype float32] [--threads 1]` builds four
random PEFT-format adapters (rank `--rank` on all seven projections, written as PEFT writes
them), serves SmolLM2-135M-Instruct with `enable_lora=True, max_loras=4`, and for each mode
admits 16 requests (the same 16 prompts), runs them until every one is decoding, then times
`--steps` decode steps of the full batch (their median is the repeat's step time). The modes
are interleaved in every repeat, in alternating order, and each mode's best repeat gives its
tokens/s (this machine is shared: other processes only ever slow a repeat down, so the least
disturbed one is the closest to the code's own speed); ratios are against the base model
measured in the same run, and every repeat's step times are printed too.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import tempfile
import time
from typing import Any

import torch
from safetensors.torch import save_file

from cluster.engine.config import EngineConfig
from cluster.engine.engine_core import EngineCore
from cluster.engine.lora_request import LoRARequest
from cluster.engine.sampling_params import SamplingParams
from workers.lora.peft_format import PROJECTIONS

BATCH = 16
PROMPT_TOKENS = 48
MODES = ("base", "one_adapter", "four_adapters")


def write_adapter(
    directory: pathlib.Path, info: Any, intermediate: int, rank: int, seed: int
) -> None:
    """A random PEFT adapter for the model of `info` (all seven projections, B non-zero)."""
    directory.mkdir(parents=True)
    q, kv = info.num_heads * info.head_dim, info.num_kv_heads * info.head_dim
    hidden = info.hidden_size
    shapes = {
        "q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden),
        "o_proj": (hidden, q), "gate_proj": (intermediate, hidden),
        "up_proj": (intermediate, hidden), "down_proj": (hidden, intermediate),
    }  # fmt: skip
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(info.num_layers):
        for projection in PROJECTIONS:
            out, inner = shapes[projection]
            part = "self_attn" if projection in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{projection}"
            tensors[f"{prefix}.lora_A.weight"] = (
                torch.randn(rank, inner, generator=generator) * 0.02
            )
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, rank, generator=generator) * 0.02
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(PROJECTIONS),
        "lora_dropout": 0.0, "bias": "none", "use_rslora": False,
    }  # fmt: skip
    (directory / "adapter_config.json").write_text(json.dumps(config))


def decode_step_seconds(engine: EngineCore, adapters: list[str | None], steps: int) -> float:
    """Admits the batch, runs it until every request decodes, then the median decode step."""
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    builder = engine.request_builder
    ids = []
    for index, adapter in enumerate(adapters):
        prompt = [1000 + (index * 97 + t * 13) % 30000 for t in range(PROMPT_TOKENS)]
        request = builder.build({"prompt_token_ids": prompt}, params, adapter=adapter)
        ids.append(engine.add_request(request).request_id)
    scheduler = engine.scheduler
    while scheduler.waiting or any(not r.branches[0].output_token_ids for r in scheduler.running):
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    for request_id in ids:
        engine.abort(request_id)
    while engine.has_work():  # the workers forget the aborted requests
        engine.step()
    return statistics.median(times)


def measure(rank: int, dtype: str, steps: int, repeats: int) -> dict[str, Any]:
    config = EngineConfig().with_overrides(
        {
            "model": {"dtype": dtype},
            "cache": {"num_device_blocks": 256, "enable_prefix_caching": False},
            "scheduler": {"max_num_seqs": BATCH, "max_num_batched_tokens": 1024},
            "parallel": {"backend": "local"},
            "lora": {"enable_lora": True, "max_loras": 4, "max_lora_rank": rank},
        }
    )
    engine = EngineCore(config)
    intermediate = engine.workers._local.description.spec.intermediate_size  # type: ignore[union-attr]
    with tempfile.TemporaryDirectory() as root:
        names = []
        for index in range(4):
            path = pathlib.Path(root) / f"adapter{index}"
            write_adapter(path, engine.model_info, intermediate, rank, seed=index)
            engine.add_lora(LoRARequest(f"adapter{index}", index + 1, str(path)))
            names.append(f"adapter{index}")
        batches: dict[str, list[str | None]] = {
            "base": [None] * BATCH,
            "one_adapter": [names[0]] * BATCH,
            "four_adapters": [names[i % 4] for i in range(BATCH)],  # interleaved
        }
        for mode in MODES:  # warm-up: slots filled, buffers touched
            decode_step_seconds(engine, batches[mode], 2)
        samples: dict[str, list[float]] = {mode: [] for mode in MODES}
        for repeat in range(repeats):
            order = MODES if repeat % 2 == 0 else tuple(reversed(MODES))
            for mode in order:
                samples[mode].append(decode_step_seconds(engine, batches[mode], steps))
    engine.shutdown()
    tok_s = {mode: BATCH / min(samples[mode]) for mode in MODES}
    return {
        "model": "SmolLM2-135M-Instruct",
        "dtype": dtype,
        "batch": BATCH,
        "adapter_rank": rank,
        "adapter_targets": "all seven projections",
        "threads": torch.get_num_threads(),
        "decode_tok_s": {mode: round(v, 1) for mode, v in tok_s.items()},
        "one_adapter_over_base": round(tok_s["one_adapter"] / tok_s["base"], 3),
        "four_adapters_over_base": round(tok_s["four_adapters"] / tok_s["base"], 3),
        "step_ms_per_repeat": {m: [round(s * 1e3, 1) for s in v] for m, v in samples.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (1: on a shared machine, spinning threads of a busy pool "
        "make single steps take seconds)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result = measure(args.rank, args.dtype, args.steps, args.repeats)
    print(json.dumps(result, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
