"""One path from the newer HTTP APIs (OpenAI Responses, Anthropic Messages) into the chat
completions machinery, so every API validates, renders, plans tools and is admitted alike.

An API module translates its request into chat-completions fields (`messages`, `tools`,
`tool_choice`, `response_format`, ...); `start_chat` validates them as a
`ChatCompletionRequest`, plans the tools (`ToolPlan`), builds the engine's sampling parameters
and admits the one rendered prompt through `OpenAIServing.submit` (`FrontEnd.submit`
underneath: one validation, one error table). `chat_pieces` reads a started run as API-neutral
pieces (reasoning text, answer text, a call's start, a call's argument text, the finish), which
each API encodes as its own stream events (a Responses `reasoning` item, an Anthropic `thinking`
block).

Invariants:
- an error names the field as the caller's API spells it (`ParamNames`), never the chat
  request's internal field;
- a request is rendered and tokenized once, by the front end (`render_only` renders what
  generation would, for token counting, without admitting anything);
- closing a pieces stream (client disconnect) closes the engine stream under it, which aborts
  the request and frees its blocks.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from cluster.engine.sampling_params import SamplingParams
from cluster.engine.tokenization import RenderedPrompt
from cluster.serving.delta_streams import finish_reason, merge_streams
from cluster.serving.error_map import ANSWERED, http_error
from cluster.serving.frontend import StreamTally, Submission
from cluster.serving.openai_protocol import (
    FinishReason,
    OpenAIError,
    error_from_validation,
    invalid_request,
)
from cluster.serving.openai_requests import ChatCompletionRequest
from cluster.serving.openai_serving import OpenAIServing, ResponseMeta
from cluster.serving.reasoning_parsers import ReasoningStream
from cluster.serving.tool_calls import ToolPlan


@dataclass(frozen=True)
class ParamNames:
    """How one API names the chat request's fields in its errors: `(pattern, replacement)`
    pairs (regular expressions over the chat field's dotted name), the first match wins."""

    renames: tuple[tuple[str, str], ...]

    def rename(self, param: str | None) -> str | None:
        if param is None:
            return None
        for pattern, replacement in self.renames:
            renamed, count = re.subn(pattern, replacement, param, count=1)
            if count:
                return renamed
        return param

    def translate(self, error: OpenAIError) -> OpenAIError:
        """`error` with its `param` (and the message's mentions of it) in this API's names;
        a message that does not mention the field then starts with it."""
        param = self.rename(error.param)
        message = error.message
        if error.param and param != error.param:
            message = message.replace(error.param, param or "")
            if param and param not in message:
                message = f"{param}: {message}"
        return OpenAIError(
            error.status,
            message,
            error_type=error.error_type,
            param=param,
            code=error.code,
            headers=error.headers,
        )


def validated_part(model: type[Any], raw: Mapping[str, Any], where: str) -> Any:
    """`raw` (one part of a request that is checked on its own, e.g. `input[2]`) as `model`;
    a 400 naming the field under `where`."""
    try:
        return model.model_validate(raw)
    except ValidationError as error:
        inner = error_from_validation(error)
        param = f"{where}.{inner.param}" if inner.param else where
        message = inner.message.replace(f"'{inner.param}'", f"'{param}'")
        raise invalid_request(message, param) from None


def chat_request_of(fields: Mapping[str, Any]) -> ChatCompletionRequest:
    """The chat request an API request translates into, validated as a chat body is."""
    try:
        request = ChatCompletionRequest.model_validate(dict(fields))
    except ValidationError as error:
        raise error_from_validation(error) from None
    request.check_supported()
    return request


@dataclass
class ChatRun:
    """A chat request admitted to the engines: its validated request, its tool plan (None: no
    tools), the engine's parameters it runs with (unset fields filled with the model's
    generation defaults), its one started engine stream and the `--reasoning-parser`'s split of
    its answer (None: no parser, all of it is answer)."""

    request: ChatCompletionRequest
    plan: ToolPlan | None
    params: SamplingParams
    submission: Submission
    reasoning: ReasoningStream | None = None


async def start_chat(
    serving: OpenAIServing,
    fields: Mapping[str, Any],
    *,
    request_id: str,
    salt: bytes | None,
    meta: ResponseMeta,
    names: ParamNames,
) -> ChatRun:
    """Validates `fields` as a chat request, plans its tools and admits it (the chat route's
    path); every refusal is raised as `OpenAIError` naming the field in `names`' spelling."""
    frontend = serving.frontend
    try:
        request = await frontend.off_loop(chat_request_of, fields)
        plan = await frontend.off_loop(request.tool_plan, serving.tools)
        params = serving.sampling_params(request, plan)
        submission = await serving.submit_chat(request, plan, params, request_id, salt, meta)
    except OpenAIError as error:
        raise names.translate(error) from None
    reasoning = None
    if serving.reasoning is not None:
        reasoning = ReasoningStream(serving.reasoning, serving.decode)
    return ChatRun(request, plan, params, submission, reasoning)


def render_only(
    serving: OpenAIServing,
    fields: Mapping[str, Any],
    names: ParamNames,
    *,
    add_generation_prompt: bool = True,
    add_special_tokens: bool = False,
) -> RenderedPrompt:
    """The prompt generation would render for `fields` (its tools listed, whatever the tool
    choice), without admitting it: for token counting and `/tokenize` (which may ask for the
    other values of the two flags). Runs on the caller's thread (call it through
    `off_loop`)."""
    fields = dict(fields)
    if fields.get("tools"):
        fields["tool_choice"] = "none"  # rendering lists the tools whatever the choice
    else:
        fields.pop("tool_choice", None)
    try:
        request = chat_request_of(fields)
        plan = request.tool_plan(serving.tools)
        render = serving.chat_render(request, plan)
        try:
            return serving.frontend.renderer.render_chat(
                request.chat_messages(),
                **render,
                add_generation_prompt=add_generation_prompt,
                add_special_tokens=add_special_tokens,
            )
        except ANSWERED as error:
            raise http_error(error, "messages") from None
    except OpenAIError as error:
        raise names.translate(error) from None


@dataclass(frozen=True)
class Started:
    """The engine admitted the prompt: its token count and how many of them were cached."""

    prompt_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class ReasoningPiece:
    """New text of the thinking span, tags dropped (never empty; only with a reasoning parser,
    always before the answer's first piece)."""

    text: str


@dataclass(frozen=True)
class TextPiece:
    """New text of the answer (never empty)."""

    text: str


@dataclass(frozen=True)
class CallStart:
    """A tool call begins: its position among the calls, id and function name."""

    index: int
    call_id: str
    name: str


@dataclass(frozen=True)
class CallArguments:
    """More of call `index`'s arguments (JSON text, never empty)."""

    index: int
    text: str


@dataclass(frozen=True)
class Finished:
    """The answer ended: `reason` as chat completions names it, the stop string that ended it
    (None for EOS, a stop token or the length limit) and the request's token counts."""

    reason: FinishReason
    stop_sequence: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


Piece = Started | ReasoningPiece | TextPiece | CallStart | CallArguments | Finished


async def chat_pieces(run: ChatRun) -> AsyncIterator[Piece]:
    """The run's answer as pieces, as they come: `Started` first (after the engine's first
    delta), `Finished` last, once. With a reasoning parser the thinking span comes first as
    `ReasoningPiece`s and only the rest is read as the answer (text that may still be a tag is
    held back). With tools, calls are read back from the answer as it grows (`ToolStream`), text
    that may start a call is held back. An engine error mid-stream propagates (one of
    `ANSWERED`)."""
    tools = None if run.plan is None else run.plan.stream()
    reasoning = run.reasoning
    tally = StreamTally()
    reason: FinishReason = "stop"
    stop_sequence = None
    async with contextlib.aclosing(merge_streams(run.submission.streams)) as merged:
        async for _, delta in merged:
            tally.add(delta)
            if delta.prompt_token_ids is not None:
                if reasoning is not None:
                    reasoning.start(delta.prompt_token_ids)
                yield Started(tally.prompt_tokens, tally.cached_tokens)
            for branch in delta.branches:
                finish = finish_reason(branch)
                answer = branch.text
                if reasoning is not None:
                    split = reasoning.piece(branch.index, branch.text, finish is not None)
                    if split.reasoning:
                        yield ReasoningPiece(split.reasoning)
                    answer = split.content
                if tools is None:
                    if answer:
                        yield TextPiece(answer)
                else:
                    content, calls = tools.update(branch.index, answer, finish is not None)
                    if content:
                        yield TextPiece(content)
                    for call in calls or []:
                        if call.id is not None:
                            yield CallStart(call.index or 0, call.id, call.function.name or "")
                        if call.function.arguments:
                            yield CallArguments(call.index or 0, call.function.arguments)
                if finish is not None:
                    reason = finish
                    if finish == "stop" and tools is not None and tools.called(branch.index):
                        reason = "tool_calls"
                    if isinstance(branch.stop_reason, str):
                        stop_sequence = branch.stop_reason
    yield Finished(
        reason, stop_sequence, tally.prompt_tokens, tally.completion_tokens, tally.cached_tokens
    )
