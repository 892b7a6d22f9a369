"""Structured outputs: what a JSON-schema constraint costs a decoding batch, how long grammars take
to compile, and how often constrained outputs validate.

`python -m benchmarks.structured --json [--steps 24] [--repeats 3] [--schemas 40] [--threads 1]`
serves SmolLM2-135M-Instruct in process and measures, side by side in one run:
- **TPOT.** A batch of 16 requests (the same 16 prompts) admitted and run until every one is
  decoding, then `--steps` decode steps of the full batch timed (their median is the repeat's
  step time), unconstrained and with a JSON schema whose one string field must be long enough
  that no request ends inside the window. The modes alternate in every repeat; each mode's best
  repeat is its TPOT (other processes only slow a repeat down) and the ratio is constrained over
  unconstrained.
- **Compile time.** `--schemas` distinct schemas compiled against the vocabulary, cold (a fresh
  cache, so the first compile also pays for the vocabulary tables, reported apart) and again
  cached; p50 and p99 of each.
- **Validity.** 16 chat requests asking for JSON under four schemas (sampled, temperature 0.7,
  `max_tokens` 160): the fraction whose output validates (`jsonschema`) among those that stopped,
  and how many were cut by `max_tokens`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import jsonschema
import torch

from cluster.engine.config import EngineConfig
from cluster.engine.engine_core import EngineCore
from cluster.engine.grammar_backend import GrammarCompilerCache
from cluster.engine.llm import LLM
from cluster.engine.sampling_params import SamplingParams
from cluster.engine.structured_outputs import StructuredOutputsParams

BATCH = 16
PROMPT_TOKENS = 48
LONG_FIELD = {
    "type": "object",
    "properties": {"story": {"type": "string", "minLength": 2000}},
    "required": ["story"],
}
"""A schema no request can finish inside the timing window (2000 characters at least)."""
VALIDITY_SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    },
    {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "population": {"type": "integer", "minimum": 0},
            "country": {"type": "string"},
        },
        "required": ["city", "population", "country"],
    },
    {
        "type": "object",
        "properties": {
            "title": {"type": "string"},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
            "rating": {"enum": [1, 2, 3, 4, 5]},
        },
        "required": ["title", "tags", "rating"],
    },
    {
        "type": "object",
        "properties": {"answer": {"type": "boolean"}, "reason": {"type": "string"}},
        "required": ["answer", "reason"],
    },
]
QUESTIONS = [
    "Describe a person as JSON.",
    "Give me a city as JSON.",
    "Review a book as JSON.",
    "Is the sky blue? Answer as JSON.",
]


def decode_step_seconds(engine: EngineCore, constrained: bool, steps: int) -> float:
    """Admits the batch, runs it until every request decodes, then the median decode step."""
    structured = StructuredOutputsParams(json=LONG_FIELD) if constrained else None
    params = SamplingParams(
        temperature=0.0, max_tokens=steps + 16, ignore_eos=True, structured_outputs=structured
    )
    ids = []
    for index in range(BATCH):
        prompt = [1000 + (index * 97 + t * 13) % 30000 for t in range(PROMPT_TOKENS)]
        request = engine.request_builder.build({"prompt_token_ids": prompt}, params)
        ids.append(engine.add_request(request).request_id)
    scheduler = engine.scheduler
    while scheduler.waiting or any(not r.branches[0].output_token_ids for r in scheduler.running):
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
        running = sum(len(r.active_branches) for r in scheduler.running)
        if running != BATCH:
            raise RuntimeError(f"the batch shrank to {running} inside the timing window")
    for request_id in ids:
        engine.abort(request_id)
    engine.flush_idle()
    return statistics.median(times)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def quantiles_ms(values: list[float], digits: int) -> dict[str, float]:
    return {
        "p50": round(percentile(values, 0.5) * 1e3, digits),
        "p99": round(percentile(values, 0.99) * 1e3, digits),
    }


def compile_times(engine: EngineCore, count: int) -> dict[str, Any]:
    cache = GrammarCompilerCache(
        engine.tokenizer,
        engine.model_info.vocab_size,
        engine.model_info.eos_token_ids,
        engine.renderer.digest,
    )
    specs = [
        StructuredOutputsParams(
            json={
                "type": "object",
                "properties": {
                    f"field_{i}": {"type": "string"},
                    "count": {"type": "integer", "minimum": 0, "maximum": i + 10},
                    "kind": {"enum": [f"k{i}", "other"]},
                    "items": {"type": "array", "items": {"type": "number"}},
                },
                "required": [f"field_{i}", "count"],
            }
        ).spec
        for i in range(count + 1)
    ]
    start = time.perf_counter()
    cache.compile(specs[0])  # the first compile also builds the vocabulary tables
    first = time.perf_counter() - start
    cold, cached = [], []
    for spec in specs[1:]:
        start = time.perf_counter()
        cache.compile(spec)
        cold.append(time.perf_counter() - start)
    for spec in specs[1:]:
        start = time.perf_counter()
        cache.compile(spec)
        cached.append(time.perf_counter() - start)
    return {
        "schemas": count,
        "first_compile_with_vocabulary_ms": round(first * 1e3, 1),
        "cold_ms": quantiles_ms(cold, 2),
        "cached_ms": quantiles_ms(cached, 4),
    }


def validity(llm: LLM) -> dict[str, Any]:
    conversations, params, schemas = [], [], []
    for index in range(BATCH):
        schema = VALIDITY_SCHEMAS[index % len(VALIDITY_SCHEMAS)]
        conversations.append([{"role": "user", "content": QUESTIONS[index % len(QUESTIONS)]}])
        params.append(
            SamplingParams(
                temperature=0.7,
                seed=index,
                max_tokens=160,
                structured_outputs=StructuredOutputsParams(json=schema),
            )
        )
        schemas.append(schema)
    outputs = llm.chat(conversations, params)
    stopped = valid = 0
    for output, schema in zip(outputs, schemas, strict=True):
        completion = output.outputs[0]
        if completion.finish_reason != "stop":
            continue
        stopped += 1
        try:
            jsonschema.validate(json.loads(completion.text), schema)
            valid += 1
        except (json.JSONDecodeError, jsonschema.ValidationError):
            pass
    return {
        "requests": BATCH,
        "stopped": stopped,
        "cut_by_max_tokens": BATCH - stopped,
        "valid_among_stopped": round(valid / stopped, 3) if stopped else None,
    }


def measure(steps: int, repeats: int, schemas: int) -> dict[str, Any]:
    config = EngineConfig().with_overrides(
        {
            "cache": {"num_device_blocks": 256, "enable_prefix_caching": False},
            "scheduler": {"max_num_seqs": BATCH, "max_num_batched_tokens": 1024},
            "parallel": {"backend": "local"},
        }
    )
    llm = LLM(config=config)
    engine = llm.engine
    compile_report = compile_times(engine, schemas)
    for constrained in (False, True):  # warm-up; also compiles the long-field schema once
        decode_step_seconds(engine, constrained, 2)
    samples: dict[str, list[float]] = {"unconstrained": [], "json_schema": []}
    for repeat in range(repeats):
        order = (False, True) if repeat % 2 == 0 else (True, False)
        for constrained in order:
            mode = "json_schema" if constrained else "unconstrained"
            samples[mode].append(decode_step_seconds(engine, constrained, steps))
    report_validity = validity(llm)
    llm.shutdown()
    tpot = {mode: min(values) for mode, values in samples.items()}
    return {
        "model": "SmolLM2-135M-Instruct",
        "batch": BATCH,
        "threads": torch.get_num_threads(),
        "tpot_ms": {mode: round(v * 1e3, 2) for mode, v in tpot.items()},
        "constrained_over_unconstrained": round(tpot["json_schema"] / tpot["unconstrained"], 3),
        "step_ms_per_repeat": {m: [round(s * 1e3, 1) for s in v] for m, v in samples.items()},
        "compile": compile_report,
        "validity": report_validity,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--schemas", type=int, default=40)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (1: on a shared machine, spinning threads of a busy pool "
        "make single steps take seconds)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    report = measure(args.steps, args.repeats, args.schemas)
    print(json.dumps(report, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
