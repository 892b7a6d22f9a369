"""Tool calls with the shipped model: how often a single question gets one call that ends.

`python -m benchmarks.tool_finish [--seeds 2] [--max-tokens 128] [--modes ...]` serves
SmolLM2-135M-Instruct in process and asks single questions (each answerable by one call of one
of four tools) the way the chat endpoint does: the tools rendered by the template the server
picks, the output constrained by the request's `tool_choice`, the calls read back by the
server's parser. For each choice (`required` with parallel calls allowed, `required` with
`parallel_tool_calls: false`, a named function, `auto`) it prints as JSON:
- `one_call_finished`: the fraction that ended by itself (`stop`) with exactly one call;
- `finished`: the fraction that ended by itself (with any number of calls);
- `mean_calls`: calls per answer; `valid`: the fraction whose calls all name a listed function
  with arguments valid against its schema (`jsonschema`).
Sampling as the OpenAI client's default (temperature 1.0), `--seeds` seeds per question.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import jsonschema

from cluster.engine.llm import LLM
from cluster.engine.sampling_params import SamplingParams
from cluster.serving.openai_requests import ChatCompletionRequest
from cluster.serving.tool_calls import ToolSettings, calls_of, render_options

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city"],
}
TIME = {
    "type": "object",
    "properties": {"timezone": {"type": "string"}},
    "required": ["timezone"],
}
CONVERT = {
    "type": "object",
    "properties": {
        "amount": {"type": "number"},
        "from_currency": {"type": "string"},
        "to_currency": {"type": "string"},
    },
    "required": ["amount", "from_currency", "to_currency"],
}
SEARCH = {
    "type": "object",
    "properties": {"query": {"type": "string"}},
    "required": ["query"],
}
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": schema},
    }
    for name, description, schema in [
        ("get_weather", "Current weather in a city", WEATHER),
        ("get_time", "Current time in a timezone", TIME),
        ("convert_currency", "Convert an amount between currencies", CONVERT),
        ("web_search", "Search the web", SEARCH),
    ]
]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
QUESTIONS = [
    ("What's the weather in Oslo?", "get_weather"),
    ("Is it raining in London right now?", "get_weather"),
    ("How hot is it in Cairo today?", "get_weather"),
    ("What time is it in Tokyo?", "get_time"),
    ("What's the current time in New York?", "get_time"),
    ("Tell me the time in Berlin.", "get_time"),
    ("Convert 100 US dollars to euros.", "convert_currency"),
    ("How many yen is 50 pounds?", "convert_currency"),
    ("Who won the 2018 World Cup?", "web_search"),
    ("Search for the best pizza recipe.", "web_search"),
    ("Find news about the Mars rover.", "web_search"),
    ("What's the weather like in Paris in fahrenheit?", "get_weather"),
]
CHOICES: dict[str, dict[str, Any]] = {
    "required": {"tool_choice": "required"},
    "required_single": {"tool_choice": "required", "parallel_tool_calls": False},
    "named": {"tool_choice": "named"},
    "auto": {"tool_choice": "auto"},
}


def request_for(question: str, expected: str, choice: dict[str, Any]) -> ChatCompletionRequest:
    body: dict[str, Any] = {
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": question}],
        "tools": TOOLS,
        **choice,
    }
    if choice["tool_choice"] == "named":
        body["tool_choice"] = {"type": "function", "function": {"name": expected}}
    return ChatCompletionRequest.model_validate(body)


def valid(calls: list[Any]) -> bool:
    try:
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    except (KeyError, ValueError, jsonschema.ValidationError):
        return False
    return True


def run(seeds: int, max_tokens: int, modes: list[str]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    settings = ToolSettings(enable_auto_tool_choice=True, tool_call_parser="hermes")
    with LLM(max_model_len=2048, max_queue_wait_s=None) as llm:
        renderer = llm.engine.request_builder.renderer
        template = renderer.tokenizer.chat_template
        for label in modes:
            choice = CHOICES[label]
            prompts, params, plans = [], [], []
            for question, expected in QUESTIONS:
                request = request_for(question, expected, choice)
                plan = request.tool_plan(settings)
                assert plan is not None
                options = render_options(plan, request.messages, template)
                rendered = renderer.render_chat(
                    request.chat_messages(),
                    chat_template=options["chat_template"],
                    tools=options["tools"],
                )
                for seed in range(seeds):
                    prompts.append({"prompt_token_ids": rendered.token_ids})
                    params.append(
                        SamplingParams(
                            temperature=1.0,
                            seed=seed,
                            max_tokens=max_tokens,
                            structured_outputs=plan.constraint(),
                        )
                    )
                    plans.append(plan)
            outputs = llm.generate(prompts, params, use_tqdm=False)
            stats = {"one_call_finished": 0, "finished": 0, "calls": 0, "valid": 0}
            examples = []
            for output, plan in zip(outputs, plans, strict=True):
                completion = output.outputs[0]
                calls = calls_of(completion.text, plan)[1]
                stopped = completion.finish_reason == "stop"
                stats["finished"] += stopped
                stats["one_call_finished"] += stopped and len(calls) == 1
                stats["calls"] += len(calls)
                stats["valid"] += bool(calls) and valid(calls)
                if len(examples) < 3:
                    examples.append(completion.text[:200])
            total = len(outputs)
            results[label] = {
                "one_call_finished": stats["one_call_finished"] / total,
                "finished": stats["finished"] / total,
                "mean_calls": stats["calls"] / total,
                "valid": stats["valid"] / total,
                "answers": total,
                "examples": examples,
            }
            print(json.dumps({label: results[label]}), flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--modes", nargs="+", default=list(CHOICES), choices=list(CHOICES))
    args = parser.parse_args()
    print(json.dumps(run(args.seeds, args.max_tokens, args.modes), indent=2))


if __name__ == "__main__":
    main()
