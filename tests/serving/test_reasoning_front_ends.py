"""`--reasoning-parser` on both front ends (no Ray: the in-process ingress over the tiny Qwen3
whose tokenizer has `<think>`/`</think>`): the thinking span goes to `reasoning_content` /
`reasoning_text`, never into the content, streamed pieces add up to the unary split, and
`chat_template_kwargs` reach the template. The oracle is the raw text of the same prompt's
tokens through /v1/completions (no parser there), split by hand at its first `</think>`."""

from __future__ import annotations

import asyncio
import json
import pathlib
from typing import Any

import grpc
import pytest

from cluster.serving.app_args import ServeAppArgs
from cluster.serving.grpc_service import GenerationRpc
from cluster.serving.grpc_validation import GrpcAbort
from cluster.serving.reasoning_parsers import REASONING_PARSERS
from protos import generation_pb2 as pb
from tests.serving.conftest import MODEL, engine_section
from tests.serving.test_front_end_server import front_end

QUESTION = [{"role": "user", "content": "Is the sky blue?"}]
END_BIAS = 2.5
"""A bias on `</think>` under which the tiny model thinks a few tokens, then ends the span."""
MAX_TOKENS = 12


def thinker_args(model_dir: pathlib.Path, parser: str) -> ServeAppArgs:
    return ServeAppArgs.model_validate(
        {
            "served_model_name": MODEL,
            "engine": engine_section(model_dir),
            "reasoning_parser": parser,
        }
    )


async def raw_text(ingress: Any, http: Any, bias: dict[str, float], **render: Any) -> str:
    """The unsplit answer: the chat prompt's tokens through /v1/completions."""
    ids = ingress.frontend.renderer.render_chat(QUESTION, **render).token_ids
    answer = await http.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0}
        | {"logit_bias": bias},
    )
    assert answer.status_code == 200, answer.text
    return str(answer.json()["choices"][0]["text"])


async def streamed(client: Any, **body: Any) -> tuple[str, str]:
    """(reasoning, content) of a streamed chat, pieces concatenated; no piece mixes the two."""
    reasoning, content = "", ""
    stream = await client.chat.completions.create(stream=True, **body)
    async for chunk in stream:
        for choice in chunk.choices:
            thought = getattr(choice.delta, "reasoning_content", None)
            assert not (thought and choice.delta.content)
            reasoning += thought or ""
            content += choice.delta.content or ""
    return reasoning, content


async def refuses_bad_template_kwargs(ingress: Any, http: Any) -> None:
    """Both front ends refuse `chat_template_kwargs` that set the renderer's own variables, or
    that are not an object, naming the field."""
    base = {"model": MODEL, "messages": QUESTION, "max_tokens": 2}
    for kwargs, param in (
        ({"messages": []}, "chat_template_kwargs.messages"),
        ({"add_generation_prompt": False}, "chat_template_kwargs.add_generation_prompt"),
        ("enable_thinking", "chat_template_kwargs"),
    ):
        answer = await http.post(
            "/v1/chat/completions", json=base | {"chat_template_kwargs": kwargs}
        )
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["param"] == param
    rpc = GenerationRpc(ingress.frontend)
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Hi")])
    for request in (
        pb.GenerateRequest(chat=chat, chat_template_kwargs_json='{"tools": 1}'),
        pb.GenerateRequest(chat=chat, chat_template_kwargs_json="{not json"),
        pb.GenerateRequest(text="Hi", chat_template_kwargs_json="{}x"),
    ):
        with pytest.raises(GrpcAbort) as caught:
            async for _ in rpc.generate(request, request_id="b", tenant_salt=None):
                pass
        assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "chat_template_kwargs" in caught.value.details


def test_http_and_grpc_split_the_span_off_the_answer(tiny_thinker_dir: pathlib.Path) -> None:
    async def body() -> None:
        async with front_end(thinker_args(tiny_thinker_dir, "deepseek_r1")) as (ing, http, cl):
            end_id = ing.frontend.renderer.tokenizer.encode("</think>", add_special_tokens=False)
            bias = {str(end_id[0]): END_BIAS}
            raw = await raw_text(ing, http, bias)
            span, tag, answer = raw.partition("</think>")
            assert span and tag and answer  # the oracle thinks, then answers
            request = {
                "model": MODEL,
                "messages": QUESTION,
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "logit_bias": bias,
            }
            whole = await cl.chat.completions.create(**request)
            message = whole.choices[0].message
            assert (message.reasoning_content, message.content) == (span, answer)
            assert span not in message.content and "</think>" not in message.content
            assert await streamed(cl, **request) == (span, answer)

            rpc = GenerationRpc(ing.frontend, reasoning=REASONING_PARSERS["deepseek_r1"])
            chat = pb.ChatMessages(
                messages=[pb.ChatMessage(role="user", content=QUESTION[0]["content"])]
            )
            sampling = pb.SamplingParameters(
                max_tokens=MAX_TOKENS, temperature=0, logit_bias={end_id[0]: END_BIAS}
            )
            thought, text = "", ""
            async for response in rpc.generate(
                pb.GenerateRequest(chat=chat, sampling=sampling), request_id="g", tenant_salt=None
            ):
                for choice in response.choices:
                    thought += choice.reasoning_text
                    text += choice.text
            assert (thought, text) == (span, answer)

    asyncio.run(body())


def test_enable_thinking_reaches_the_template_and_qwen3_answers_plainly(
    tiny_thinker_dir: pathlib.Path,
) -> None:
    """Qwen3's parser: with `enable_thinking: false` the template closes the span in the
    prompt, so the whole answer is content (the raw text of that very prompt); without it the
    output does not open a span either, so again no reasoning field. Bad kwargs are refused."""

    async def body() -> None:
        async with front_end(thinker_args(tiny_thinker_dir, "qwen3")) as (ing, http, client):
            closed = {"enable_thinking": False}
            raw_closed = await raw_text(ing, http, {}, chat_template_kwargs=closed)
            raw_open = await raw_text(ing, http, {})
            assert raw_closed != raw_open  # the flag changed the prompt
            base = {"model": MODEL, "messages": QUESTION, "max_tokens": MAX_TOKENS}
            base |= {"temperature": 0}
            for extra, raw in (({"chat_template_kwargs": closed}, raw_closed), ({}, raw_open)):
                answer = await http.post("/v1/chat/completions", json=base | extra)
                message = answer.json()["choices"][0]["message"]
                assert "reasoning_content" not in message
                assert message["content"] == raw
                assert await streamed(client, **base, extra_body=extra) == ("", raw)
            rpc = GenerationRpc(ing.frontend, reasoning=REASONING_PARSERS["qwen3"])
            chat = pb.ChatMessages(
                messages=[pb.ChatMessage(role="user", content=QUESTION[0]["content"])]
            )
            request = pb.GenerateRequest(
                chat=chat,
                sampling=pb.SamplingParameters(max_tokens=MAX_TOKENS, temperature=0),
                chat_template_kwargs_json=json.dumps(closed),
            )
            texts = []
            async for response in rpc.generate(request, request_id="q", tenant_salt=None):
                texts.extend(choice.text for choice in response.choices)
                assert not any(choice.reasoning_text for choice in response.choices)
            assert "".join(texts) == raw_closed
            await refuses_bad_template_kwargs(ing, http)

    asyncio.run(body())
