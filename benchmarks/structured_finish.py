"""Structured outputs with the shipped model: how often a schema-constrained chat answer ends by
itself, and what raises that.

`python -m benchmarks.structured_finish [--seeds 2] [--max-tokens 256] [--variants ...]` serves
SmolLM2-135M-Instruct in process and asks 16 everyday questions, each with the schema a
pydantic model gives (as `client.chat.completions.parse` sends it: strict, every field
required, no additional properties), sampled as the OpenAI client does by default
(temperature 1.0; `--temperature 0` is greedy), `--seeds` seeds each. Variants (each on the
same questions and seeds):
- `plain`: the schema constrains decoding, the prompt is the question alone;
- `prompted`: the schema also stated in a system turn (`schema_instruction`), as OpenAI's
  and llama-server's templates show a response format or tools to the model.
The engine bounds open lengths (`json_bounds.bounded_schema`) and guards against a token cycle
repeating without end (`cycle_guard`) on every constrained request; run this script on a tree
without them for the figures before them.
It prints as JSON per variant: `finished` (the fraction that stopped before `--max-tokens`),
`valid` (the fraction of finished answers that validate against the user's schema,
`jsonschema`), and a few cut answers' endings.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import jsonschema

from cluster.engine.llm import LLM
from cluster.engine.sampling_params import SamplingParams
from cluster.engine.structured_outputs import StructuredOutputsParams


def _model(properties: dict[str, Any]) -> dict[str, Any]:
    """The schema pydantic and the openai client's `.parse` send for these fields."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


STR, INT, NUM, BOOL = (
    {"type": "string"},
    {"type": "integer"},
    {"type": "number"},
    {"type": "boolean"},
)
CASES: list[tuple[str, dict[str, Any]]] = [
    ("Give me a city.", _model({"name": STR, "country": STR, "population": INT})),
    ("Invent a person.", _model({"name": STR, "age": INT})),
    ("Recommend a book.", _model({"title": STR, "author": STR, "year": INT})),
    ("Name a good movie.", _model({"title": STR, "year": INT, "rating": NUM})),
    ("Describe a product in a shop.", _model({"name": STR, "price": NUM, "in_stock": BOOL})),
    (
        "Give me a simple recipe.",
        _model({"name": STR, "ingredients": {"type": "array", "items": STR}, "minutes": INT}),
    ),
    (
        "What's the weather like in Paris?",
        _model(
            {"city": STR, "temperature": NUM, "condition": {"enum": ["sunny", "cloudy", "rainy"]}}
        ),
    ),
    ("Tell me about an animal.", _model({"species": STR, "legs": INT, "can_fly": BOOL})),
    (
        "Pick a country.",
        _model({"name": STR, "capital": STR, "continent": {"enum": ["Africa", "Asia", "Europe"]}}),
    ),
    ("Plan a birthday party.", _model({"title": STR, "date": STR, "location": STR})),
    (
        "Pick a color.",
        _model({"name": STR, "hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}}),
    ),
    (
        "Classify the sentiment of: I love this phone!",
        _model({"sentiment": {"enum": ["positive", "negative", "neutral"]}, "confidence": NUM}),
    ),
    (
        "Add a to-do item.",
        _model({"task": STR, "priority": {"enum": ["low", "medium", "high"]}, "done": BOOL}),
    ),
    ("Write an address.", _model({"street": STR, "city": STR, "postal_code": STR})),
    ("Suggest a song.", _model({"title": STR, "artist": STR, "genre": STR})),
    ("What is 12 times 7?", _model({"answer": INT, "explanation": STR})),
]
VARIANTS = ["plain", "prompted"]


def schema_instruction(schema: dict[str, Any]) -> str:
    """The schema stated for the model: what its answer must be."""
    return "Answer with a JSON object that matches this JSON schema:\n" + json.dumps(schema)


def _request(
    question: str,
    schema: dict[str, Any],
    variant: str,
    seed: int,
    max_tokens: int,
    temperature: float,
) -> tuple[list[dict[str, str]], SamplingParams]:
    messages = [{"role": "user", "content": question}]
    if variant == "prompted":
        messages.insert(0, {"role": "system", "content": schema_instruction(schema)})
    params = SamplingParams(
        temperature=temperature,
        seed=seed,
        max_tokens=max_tokens,
        structured_outputs=StructuredOutputsParams(json=schema),
    )
    return messages, params


def run(seeds: int, max_tokens: int, variants: list[str], temperature: float) -> dict[str, Any]:
    results: dict[str, Any] = {}
    with LLM(max_model_len=2048, max_queue_wait_s=None) as llm:
        for variant in variants:
            conversations, params, schemas = [], [], []
            for question, schema in CASES:
                for seed in range(seeds):
                    messages, sampling = _request(
                        question, schema, variant, seed, max_tokens, temperature
                    )
                    conversations.append(messages)
                    params.append(sampling)
                    schemas.append(schema)
            outputs = llm.chat(conversations, params, use_tqdm=False)
            finished = valid = 0
            cut: list[str] = []
            for output, schema in zip(outputs, schemas, strict=True):
                completion = output.outputs[0]
                if completion.finish_reason != "stop":
                    cut.append(completion.text[-60:])
                    continue
                finished += 1
                try:
                    jsonschema.validate(json.loads(completion.text), schema)
                    valid += 1
                except (ValueError, jsonschema.ValidationError):
                    pass
            results[variant] = {
                "finished": finished / len(outputs),
                "valid_of_finished": valid / finished if finished else None,
                "answers": len(outputs),
                "cut_endings": cut[:4],
            }
            print(json.dumps({variant: results[variant]}), flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS)
    parser.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    args = parser.parse_args()
    results = run(args.seeds, args.max_tokens, args.variants, args.temperature)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
