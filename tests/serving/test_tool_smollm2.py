"""Tool calls with the shipped model (SmolLM2-135M-Instruct), where the model matters: asked one
question under `tool_choice: "required"` with `parallel_tool_calls: false`, every answer is one
call, in the template's own form, that ends by itself (not cut by `max_tokens`) and names a
listed function with arguments valid against its schema (`jsonschema`). Requests are planned,
rendered, constrained and read back as the chat endpoint does."""

from __future__ import annotations

import json

import jsonschema
import pytest

from benchmarks.tool_finish import SCHEMAS, TOOLS
from cluster.engine.llm import LLM
from cluster.engine.sampling_params import SamplingParams
from cluster.serving.openai_requests import ChatCompletionRequest
from cluster.serving.tool_calls import ToolSettings, calls_of, render_options

pytestmark = pytest.mark.smollm2

QUESTIONS = [
    "What's the weather in Oslo?",
    "What time is it in Tokyo?",
    "Convert 100 US dollars to euros.",
    "Search for the best pizza recipe.",
]


def test_one_question_gets_one_call_that_ends() -> None:
    with LLM(max_model_len=1024) as llm:
        renderer = llm.engine.request_builder.renderer
        settings = ToolSettings().for_template(renderer.tokenizer.chat_template)
        prompts, params, plans = [], [], []
        for seed, question in enumerate(QUESTIONS):
            request = ChatCompletionRequest.model_validate(
                {
                    "model": "m",
                    "messages": [{"role": "user", "content": question}],
                    "tools": TOOLS,
                    "tool_choice": "required",
                    "parallel_tool_calls": False,
                }
            )
            plan = request.tool_plan(settings)
            assert plan is not None
            options = render_options(plan, request.messages, renderer.tokenizer.chat_template)
            rendered = renderer.render_chat(request.chat_messages(), **options)
            prompts.append({"prompt_token_ids": rendered.token_ids})
            params.append(
                SamplingParams(
                    temperature=1.0,
                    seed=seed,
                    max_tokens=128,
                    structured_outputs=plan.constraint(),
                )
            )
            plans.append(plan)
        outputs = llm.generate(prompts, params, use_tqdm=False)
    for output, plan in zip(outputs, plans, strict=True):
        completion = output.outputs[0]
        _, calls = calls_of(completion.text, plan)
        assert completion.finish_reason == "stop" and len(calls) == 1, completion.text
        arguments = json.loads(calls[0].function.arguments or "")
        jsonschema.validate(arguments, SCHEMAS[calls[0].function.name or ""])
