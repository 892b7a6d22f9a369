"""`--reasoning-parser` on OpenAI's Responses API and Anthropic's Messages API (no Ray: the
in-process ingress over the tiny Qwen3 whose tokenizer has `<think>`/`</think>`): the thinking
span is a `reasoning` output item (`response.reasoning_text.*` events) and a `thinking` content
block (`thinking_delta` events), never answer text, as the official `openai` and `anthropic`
SDKs parse them; streamed and unary answers agree, and a client may send the answer back in a
next turn. The oracle is the raw text of the same prompt's tokens through /v1/completions (no
parser there), split by hand at its first `</think>`.

Neither API has `logit_bias`; the test adds it to the chat fields both translate into (the
split under test is downstream of them), so that the tiny model ends its span."""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import httpx
import httpx2
import openai
import pytest
from anthropic.types import (
    RawContentBlockDeltaEvent,
    SignatureDelta,
    TextBlock,
    ThinkingBlock,
    ThinkingDelta,
)
from openai.types.responses import (
    ResponseCompletedEvent,
    ResponseIncompleteEvent,
    ResponseOutputMessage,
    ResponseReasoningItem,
    ResponseReasoningTextDeltaEvent,
    ResponseReasoningTextDoneEvent,
    ResponseTextDeltaEvent,
)

from benchmarks.front_end_server import local_ingress
from cluster.serving.anthropic_requests import MessagesRequest
from cluster.serving.api_surface import build_serving_api
from cluster.serving.app_args import ServeAppArgs
from cluster.serving.responses_requests import ResponsesRequest
from tests.serving.conftest import MODEL
from tests.serving.test_reasoning_front_ends import (
    END_BIAS,
    MAX_TOKENS,
    QUESTION,
    raw_text,
    thinker_args,
)


@contextlib.asynccontextmanager
async def whole_surface(
    args: ServeAppArgs,
) -> AsyncIterator[tuple[Any, httpx.AsyncClient, openai.AsyncOpenAI, anthropic.AsyncAnthropic]]:
    """The no-Ray ingress with every HTTP route, a raw client, OpenAI's and Anthropic's."""
    async with local_ingress(args) as ingress:
        app = build_serving_api(ingress)
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://fe")
        oai = openai.AsyncOpenAI(api_key="none", base_url="http://fe/v1", http_client=http)
        claude = anthropic.AsyncAnthropic(  # its SDK speaks through httpx2
            base_url="http://fe",
            api_key="none",
            http_client=httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app)),
            max_retries=0,
        )
        yield ingress, http, oai, claude


def biased(monkeypatch: pytest.MonkeyPatch, bias: dict[str, float]) -> None:
    """Both APIs' requests carry `bias` as chat's `logit_bias`."""
    responses_fields = ResponsesRequest.chat_fields
    messages_fields = MessagesRequest.chat_fields
    monkeypatch.setattr(
        ResponsesRequest,
        "chat_fields",
        lambda self, conversation: responses_fields(self, conversation) | {"logit_bias": bias},
    )
    monkeypatch.setattr(
        MessagesRequest, "chat_fields", lambda self: messages_fields(self) | {"logit_bias": bias}
    )


async def check_responses(client: Any, span: str, answer: str) -> None:
    request = {
        "model": MODEL,
        "input": QUESTION[0]["content"],
        "max_output_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    whole = await client.responses.create(**request)
    reasoning, message = whole.output
    assert isinstance(reasoning, ResponseReasoningItem)
    assert [c.text for c in reasoning.content or []] == [span] and reasoning.summary == []
    assert isinstance(message, ResponseOutputMessage)
    assert whole.output_text == answer

    events = [event async for event in await client.responses.create(stream=True, **request)]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    thought = "".join(e.delta for e in events if isinstance(e, ResponseReasoningTextDeltaEvent))
    text = "".join(e.delta for e in events if isinstance(e, ResponseTextDeltaEvent))
    assert (thought, text) == (span, answer)
    (done,) = [e for e in events if isinstance(e, ResponseReasoningTextDoneEvent)]
    assert done.text == span and done.output_index == 0
    kinds = [e.type for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    final = events[-1]
    assert isinstance(final, ResponseCompletedEvent | ResponseIncompleteEvent)
    assert final.response.status == whole.status
    streamed_output = [
        (item.type, item.model_dump(exclude={"id"})) for item in final.response.output
    ]
    assert streamed_output == [
        (item.type, item.model_dump(exclude={"id"})) for item in whole.output
    ]

    # the next turn: by previous_response_id, and with the output sent back as input items
    follow = {"model": MODEL, "max_output_tokens": 2, "temperature": 0}
    by_id = await client.responses.create(previous_response_id=whole.id, input="Why?", **follow)
    sent_back = [item.model_dump(exclude_none=True) for item in whole.output]
    by_items = await client.responses.create(
        input=[*sent_back, {"role": "user", "content": "Why?"}], **follow
    )
    assert by_id.output_text == by_items.output_text  # the same conversation either way


async def check_messages(claude: anthropic.AsyncAnthropic, span: str, answer: str) -> None:
    request = {
        "model": MODEL,
        "max_tokens": MAX_TOKENS,
        "messages": QUESTION,
        "extra_body": {"temperature": 0},  # this SDK takes sampling fields only so
    }
    whole = await claude.messages.create(**request)
    thinking, text = whole.content
    assert isinstance(thinking, ThinkingBlock) and thinking.thinking == span
    assert isinstance(text, TextBlock) and text.text == answer

    deltas = []
    async with claude.messages.stream(**request) as stream:
        async for event in stream:
            if isinstance(event, RawContentBlockDeltaEvent):
                deltas.append((event.index, event.delta))
        final = await stream.get_final_message()
    thought = "".join(d.thinking for i, d in deltas if isinstance(d, ThinkingDelta) and i == 0)
    assert thought == span
    assert [i for i, d in deltas if isinstance(d, SignatureDelta)] == [0]
    assert [block.model_dump() for block in final.content] == [
        block.model_dump() for block in whole.content
    ]

    turns = [
        *QUESTION,
        {"role": "assistant", "content": [b.model_dump() for b in whole.content]},
        {"role": "user", "content": "Why?"},
    ]
    follow = await claude.messages.create(model=MODEL, max_tokens=2, messages=turns)
    assert follow.stop_reason in ("max_tokens", "end_turn")


def test_responses_and_messages_split_the_span_off_the_answer(
    tiny_thinker_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def body() -> None:
        args = thinker_args(tiny_thinker_dir, "deepseek_r1")
        async with whole_surface(args) as (ing, http, oai, claude):
            end_id = ing.frontend.renderer.tokenizer.encode("</think>", add_special_tokens=False)
            bias = {str(end_id[0]): END_BIAS}
            span, tag, answer = (await raw_text(ing, http, bias)).partition("</think>")
            assert span and tag and answer  # the oracle thinks, then answers
            biased(monkeypatch, bias)
            await check_responses(oai, span, answer)
            await check_messages(claude, span, answer)

    asyncio.run(body())
