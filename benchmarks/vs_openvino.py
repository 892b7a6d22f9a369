"""Offline throughput side by side with OpenVINO GenAI on the same GGUF and the same tokens.

``python -m benchmarks.vs_openvino --json`` renders `--prompts` natural-text chats
(``benchmarks.chat_corpus``) with the default model's chat template, then generates
`--max-tokens` greedy tokens per prompt (EOS ignored) with all prompts submitted at once:

- OpenVINO GenAI's ``ContinuousBatchingPipeline(model.gguf, SchedulerConfig(), "CPU")`` (paged
  attention, continuous batching, prefix caching on; ``--openvino-properties`` passes CPU plugin
  properties), in its own virtual environment outside the
  repository (``--openvino-python``, else ``$PAGEDSERVE_OPENVINO_PYTHON``, else
  ``~/.cache/pagedserve/openvino-genai/bin/python``; made with ``pip install openvino-genai``);
- ours: ``LLM()`` with its defaults (``--llm-args`` adds keyword arguments as JSON).

Both get the same prompt token ids; each side runs a short warm-up first and is timed on the
whole batch. It prints output tok/s per side, ``ours_over_openvino`` and the fraction of prompts
whose greedy tokens agree exactly, with the mean number of leading tokens the two sides share
(the two compute in different precisions, so near ties may differ). A missing OpenVINO venv
makes that side ``skipped`` with the reason.

``--model PATH`` runs both sides on another GGUF file (its own tokenizer and chat template), e.g.
the benchmark model of ``benchmarks.make_bench_model``. Ours also reports under ``weights`` the
steps' weight bytes (from the forms its layers hold at the run's mean rows per step), the tokens
per step, bytes per decoded token and the weight stream sustained against ``memory_read_gbs``
(`benchmarks.weight_traffic`), with the load average around each side.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import weight_traffic
from benchmarks.chat_corpus import chat_prompts

RUNNER = Path(__file__).with_name("openvino_runner.py")
ENV_VAR = "PAGEDSERVE_OPENVINO_PYTHON"


def common_prefix_length(ours: list[int], theirs: list[int]) -> int:
    """How many leading tokens two generations share."""
    for position, (a, b) in enumerate(zip(ours, theirs, strict=False)):
        if a != b:
            return position
    return min(len(ours), len(theirs))


def openvino_python(explicit: str | None) -> Path | None:
    candidates = [explicit, os.environ.get(ENV_VAR)]
    candidates.append(str(Path.home() / ".cache/pagedserve/openvino-genai/bin/python"))
    for candidate in candidates:
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return Path(candidate)
    return None


def run_openvino(
    python: Path,
    model: Path,
    prompts: list[list[int]],
    warmup: list[list[int]],
    max_tokens: int,
    properties: dict[str, str] | None = None,
) -> dict[str, Any]:
    spec = {
        "model": str(model),
        "prompts": prompts,
        "warmup": warmup,
        "max_tokens": max_tokens,
        "properties": properties or {},
    }
    with tempfile.NamedTemporaryFile("w", suffix=".json") as handle:
        json.dump(spec, handle)
        handle.flush()
        done = subprocess.run(
            [str(python), str(RUNNER), handle.name], capture_output=True, text=True, check=False
        )
    if done.returncode != 0:
        return {"skipped": f"the OpenVINO runner failed: {done.stderr[-2000:]}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_ours(
    model: str,
    prompts: list[list[int]],
    warmup: list[list[int]],
    max_tokens: int,
    llm_args: dict[str, Any],
    bandwidth: float,
) -> dict[str, Any]:
    from pagedserve import LLM, SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    with LLM(model, **llm_args) as llm:
        llm.generate([{"prompt_token_ids": ids} for ids in warmup], SamplingParams(max_tokens=8))
        before = llm.metrics()
        began = time.perf_counter()
        results = llm.generate([{"prompt_token_ids": ids} for ids in prompts], greedy)
        elapsed = time.perf_counter() - began
        after = llm.metrics()
        config = llm.engine.config
        steps = after.num_steps - before.num_steps
        tokens = after.num_generated_tokens - before.num_generated_tokens
        rows = max(1, round(tokens / max(1, steps)))
        step_bytes = weight_traffic.model_step_bytes(llm.engine.workers.local_rank.model, rows)
        return {
            "elapsed_s": elapsed,
            "outputs": [r.outputs[0].token_ids for r in results],
            "dtype": llm.engine.model_info.dtype,
            "quantized_activations": llm.engine.model_info.quantized_activations,
            "max_num_seqs": config.scheduler.max_num_seqs,
            "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
            "weights": weight_traffic.traffic(step_bytes, tokens, steps, elapsed, bandwidth),
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--openvino-python", help=f"OpenVINO venv's python (else ${ENV_VAR})")
    parser.add_argument("--llm-args", default="{}", help="JSON keyword arguments for LLM()")
    parser.add_argument(
        "--openvino-properties",
        default="{}",
        help="JSON properties for OpenVINO's CPU plugin, e.g. "
        '\'{"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32", '
        '"DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"}\' (no compression, no int8 activations)',
    )
    parser.add_argument("--only", choices=("ours", "openvino"), help="run one side")
    parser.add_argument("--model", default="default", help="a .gguf file (both sides)")
    args = parser.parse_args(argv)

    from workers import load_tokenizer
    from workers.cpu_features import CpuFeatures
    from workers.model_source import resolve_model_path

    model = resolve_model_path(args.model)
    tokenizer = load_tokenizer(args.model)
    bandwidth = weight_traffic.read_bandwidth_gbs()
    loads = {"start": os.getloadavg()}

    def render(messages: list[dict[str, str]]) -> list[int]:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    prompts = [render(chat) for chat in chat_prompts(args.prompts, args.seed)]
    warmup = [render(chat) for chat in chat_prompts(2, args.seed + 1)]
    sides: dict[str, dict[str, Any]] = {}
    if args.only != "ours":
        python = openvino_python(args.openvino_python)
        sides["openvino"] = (
            run_openvino(
                python,
                model,
                prompts,
                warmup,
                args.max_tokens,
                json.loads(args.openvino_properties),
            )
            if python is not None
            else {"skipped": "no OpenVINO GenAI venv (pip install openvino-genai in one)"}
        )
        loads["after_openvino"] = os.getloadavg()
    if args.only != "openvino":
        sides["pagedserve"] = run_ours(
            args.model, prompts, warmup, args.max_tokens, json.loads(args.llm_args), bandwidth
        )
        loads["after_pagedserve"] = os.getloadavg()
    for side in sides.values():
        if "outputs" in side:
            side["output_tokens"] = sum(len(o) for o in side["outputs"])
            side["output_tok_s"] = side["output_tokens"] / side["elapsed_s"]
    ours, theirs = sides.get("pagedserve", {}), sides.get("openvino", {})
    ratio = None
    agree = None
    common_prefix = None
    if "output_tok_s" in ours and "output_tok_s" in theirs:
        ratio = ours["output_tok_s"] / theirs["output_tok_s"]
        pairs = list(zip(ours["outputs"], theirs["outputs"], strict=True))
        agree = sum(a == b for a, b in pairs) / len(prompts)
        common_prefix = sum(common_prefix_length(a, b) for a, b in pairs) / len(prompts)
    result = {
        "benchmark": "vs_openvino",
        "ours_over_openvino": ratio,
        "greedy_agreement": agree,
        "greedy_common_prefix_tokens_mean": common_prefix,
        "cpu": CpuFeatures.detect().kind,
        "model": str(model),
        "memory_read_gbs": round(bandwidth, 2),
        "openvino_file_weight_bytes_per_step": weight_traffic.gguf_step_bytes(model),
        "load_average": loads,
        "prompts": len(prompts),
        "prompt_tokens": {"min": min(map(len, prompts)), "max": max(map(len, prompts))},
        "max_tokens": args.max_tokens,
        **{name: {k: v for k, v in side.items() if k != "outputs"} for name, side in sides.items()},
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for name, side in sides.items():
            print(f"{name:10} {side.get('output_tok_s', side.get('skipped'))}")
        print(f"ours/openvino {ratio}  greedy agreement {agree}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
