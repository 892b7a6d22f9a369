"""Output-token throughput: our engine vs HF transformers on the same weights, same run.

`python -m benchmarks.throughput --json [--quick]` prints one JSON object. The workload is a
seeded set of prompts (random token ids of mixed lengths) with mixed output lengths, EOS ignored
so every system generates exactly the same number of tokens per request:
- ours: `LLM.generate` (continuous batching, paged KV, in-process worker);
- `hf_generate`: padded batched `model.generate` in batches of `--hf-batch-size`, each batch
  decoding to its longest request (the padding is that baseline's real cost: only the requested
  tokens count as output);
- `hf_generate_batch`: transformers' own continuous batching, where the installed version has it
  (one `max_new_tokens` for all: every token it produced is counted, which favours it).
Ours also reports `steps_per_s` and `scheduler_us_per_step` (Python time of schedule() +
on_step_done() per step in that run), and `engine_overhead` is the same at `--max-num-seqs`
running sequences with no model (`benchmarks.engine_overhead`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks import engine_overhead


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def total_output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(num_requests: int, input_range: tuple[int, int], output_range: tuple[int, int],
                  seed: int) -> Workload:  # fmt: skip
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(300, 40000) for _ in range(rng.randint(*input_range))]
        for _ in range(num_requests)
    ]
    return Workload(prompts, [rng.randint(*output_range) for _ in range(num_requests)])


def run_ours(args: argparse.Namespace, workload: Workload) -> dict[str, Any]:
    from cluster.engine.llm import LLM
    from cluster.engine.sampling_params import SamplingParams

    llm = LLM(
        args.model,
        kv_cache_bytes=args.kv_cache_mib * 2**20,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=2048,
    )
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in workload.output_lens
    ]
    prompts = [{"prompt_token_ids": p} for p in workload.prompts]
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2))  # warm up
    scheduler = llm.engine.scheduler
    spent = [0.0]
    for name in ("schedule", "on_step_done"):
        method = getattr(scheduler, name)

        def timed(*call_args: Any, _method: Any = method) -> Any:
            begin = time.perf_counter()
            try:
                return _method(*call_args)
            finally:
                spent[0] += time.perf_counter() - begin

        setattr(scheduler, name, timed)
    steps_before = llm.metrics().num_steps
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert produced == workload.total_output_tokens, (produced, workload.total_output_tokens)
    metrics = llm.metrics()
    steps = metrics.num_steps - steps_before
    result = {
        "seconds": round(seconds, 2),
        "output_tokens": produced,
        "output_tokens_per_s": round(produced / seconds, 2),
        "peak_kv_utilization": round(metrics.peak_kv_utilization, 4),
        "peak_used_device_blocks": metrics.peak_used_device_blocks,
        "device_blocks": metrics.pressure.device.total,
        "preemptions_recompute": metrics.preemptions_recompute,
        "preemptions_swap": metrics.preemptions_swap,
        "prefix_hit_rate": round(metrics.prefix_cache_hit_rate, 4),
        "steps": metrics.num_steps,
        "steps_per_s": round(steps / seconds, 2),
        "scheduler_us_per_step": round(spent[0] / max(steps, 1) * 1e6, 1),
    }
    llm.shutdown()
    return result


def load_hf_model(model: str) -> Any:
    import transformers

    from workers import resolve_model_path

    path = resolve_model_path(model)
    if path.suffix == ".gguf":
        return transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, torch_dtype=torch.float32
        ).eval()
    return transformers.AutoModelForCausalLM.from_pretrained(str(path)).eval()


def run_hf_generate(model: Any, workload: Workload, batch_size: int) -> dict[str, Any]:
    order = sorted(range(len(workload.prompts)), key=lambda i: len(workload.prompts[i]))
    start = time.perf_counter()
    with torch.no_grad():
        for first in range(0, len(order), batch_size):
            batch = order[first : first + batch_size]
            width = max(len(workload.prompts[i]) for i in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for row, i in enumerate(batch):
                prompt = workload.prompts[i]
                ids[row, width - len(prompt) :] = torch.tensor(prompt)
                mask[row, width - len(prompt) :] = 1
            new = max(workload.output_lens[i] for i in batch)
            model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                do_sample=False, pad_token_id=0, eos_token_id=None,
            )  # fmt: skip
    seconds = time.perf_counter() - start
    useful = workload.total_output_tokens
    return {
        "seconds": round(seconds, 2),
        "output_tokens": useful,
        "output_tokens_per_s": round(useful / seconds, 2),
        "batch_size": batch_size,
    }


def run_hf_generate_batch(model: Any, workload: Workload) -> dict[str, Any] | None:
    import transformers

    if not hasattr(model, "generate_batch"):
        return None
    config = transformers.GenerationConfig(
        max_new_tokens=max(workload.output_lens), do_sample=False, eos_token_id=None,
        pad_token_id=0,
    )  # fmt: skip
    start = time.perf_counter()
    results = model.generate_batch(inputs=workload.prompts, generation_config=config)
    seconds = time.perf_counter() - start
    produced = sum(len(r.generated_tokens) for r in results.values())
    return {
        "seconds": round(seconds, 2),
        "output_tokens": produced,
        "output_tokens_per_s": round(produced / seconds, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    parser.add_argument("--quick", action="store_true", help="a small workload (~2-3 minutes)")
    parser.add_argument("--model", default="default")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--kv-cache-mib", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--skip-generate-batch", action="store_true")
    args = parser.parse_args()
    if args.quick:
        workload = make_workload(8, (32, 96), (16, 48), args.seed)
    else:
        workload = make_workload(64, (64, 512), (32, 256), args.seed)
    ours = run_ours(args, workload)
    overhead = engine_overhead.measure(args.max_num_seqs)
    model = load_hf_model(args.model)
    hf = run_hf_generate(model, workload, args.hf_batch_size)
    hf_batch = None if args.skip_generate_batch else run_hf_generate_batch(model, workload)
    result: dict[str, Any] = {
        "workload": {
            "requests": len(workload.prompts),
            "input_tokens": sum(len(p) for p in workload.prompts),
            "output_tokens": workload.total_output_tokens,
            "quick": args.quick,
        },
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "ours": ours,
        "engine_overhead": overhead,
        "hf_generate": hf,
        "hf_generate_batch": hf_batch,
        "ratio_vs_hf_generate": round(ours["output_tokens_per_s"] / hf["output_tokens_per_s"], 3),
        "ratio_vs_hf_generate_batch": (
            round(ours["output_tokens_per_s"] / hf_batch["output_tokens_per_s"], 3)
            if hf_batch
            else None
        ),
        "peak_kv_utilization": ours["peak_kv_utilization"],
        "preemptions": ours["preemptions_recompute"] + ours["preemptions_swap"],
        "prefix_hit_rate": ours["prefix_hit_rate"],
    }
    print(json.dumps(result, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
