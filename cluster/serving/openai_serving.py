"""OpenAI-compatible serving over an `EngineClient`: runs completions and chat completions and
shapes engine outputs into OpenAI responses and server-sent-event chunks.

Invariants:
- every refusal the engine makes before generating (prompt too long, `max_tokens` beyond the
  context, queue full, invalid sampling values, a LoRA adapter it no longer serves) is raised as
  `OpenAIError` before the first byte of a response, so it gets its HTTP status (400, 404
  `model_not_found`, or 503 with Retry-After);
- a response names the model it was generated with: the served model, or the adapter's name;
- an error after streaming began becomes an OpenAI error event, which the `openai` client raises;
- closing a response stream (client disconnect) closes every engine stream under it, which
  aborts those requests and frees their blocks;
- in a stream, each choice's finish is reported exactly once, and a chat choice's first chunk
  carries the assistant role.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import BaseModel

from cluster.engine.client import EngineClient
from cluster.engine.errors import AdapterNotFound, EngineDead, EngineOverloaded, RequestRejected
from cluster.engine.generate_request import PromptInput
from cluster.engine.outputs import CompletionOutput, Logprob, RequestOutput
from cluster.engine.sampling_params import SamplingParams
from cluster.serving.frontend import (
    ENGINE_ERRORS,
    ContextOverflow,
    FinishTracker,
    FrontEnd,
    new_logprobs,
)
from cluster.serving.openai_protocol import (
    SSE_DONE,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    FinishReason,
    OpenAIError,
    Prompt,
    SamplingKwargs,
    TopLogprob,
    Usage,
    invalid_request,
    model_not_found,
    overloaded,
    sse_event,
)
from cluster.serving.tool_calls import (
    ToolPlan,
    ToolSettings,
    ToolStream,
    calls_of,
    render_options,
)

Stream = AsyncGenerator[RequestOutput, None]


def engine_prompt(prompt: Prompt) -> PromptInput:
    """A completions prompt as the engine takes it (token ids skip the tokenizer)."""
    return prompt if isinstance(prompt, str) else {"prompt_token_ids": list(prompt)}


def http_error(error: Exception, param: str | None = None) -> OpenAIError:
    """The HTTP error an engine or front-end error maps to (`param`: the prompt's field)."""
    if isinstance(error, AdapterNotFound):  # unloaded after the front end resolved it
        return model_not_found(str(error))
    if isinstance(error, ContextOverflow):
        return invalid_request(str(error), param=param, code="context_length_exceeded")
    if isinstance(error, EngineOverloaded):
        return overloaded(str(error), retry_after_s=max(1, math.ceil(error.retry_after_s)))
    if isinstance(error, EngineDead):
        return OpenAIError(503, str(error), error_type="server_error", code="engine_unavailable")
    return invalid_request(str(error), param=param)  # RequestRejected, ValueError


def sampling_params(kwargs: SamplingKwargs, tools: ToolPlan | None = None) -> SamplingParams:
    """The engine's parameters; a tool plan's grammar (required or named choice) constrains
    the output."""
    if tools is not None and tools.constraint() is not None:
        kwargs = SamplingKwargs(**{**kwargs, "structured_outputs": tools.constraint()})
    try:
        return SamplingParams(**kwargs)
    except ValueError as error:
        raise invalid_request(str(error)) from None


async def _chain(first: RequestOutput, rest: Stream) -> Stream:
    try:
        yield first
        async for output in rest:
            yield output
    finally:
        await rest.aclose()


@dataclass
class ResponseMeta:
    """What a route learns about a response besides its body: the engine replica that served
    it (None in process), for the `x-pagedserve-replica` header."""

    served_by: str | None = None


@dataclass
class _End:
    error: Exception | None = None


async def merge_streams(streams: Sequence[Stream]) -> AsyncGenerator[tuple[int, RequestOutput]]:
    """Interleaves streams as `(stream index, output)` in arrival order. Closing the merged
    stream, or an error in any input, closes every input (which aborts their requests)."""
    queue: asyncio.Queue[tuple[int, RequestOutput | _End]] = asyncio.Queue()

    async def pump(index: int, stream: Stream) -> None:
        try:
            async for item in stream:
                await queue.put((index, item))
            await queue.put((index, _End()))
        except Exception as error:
            await queue.put((index, _End(error)))
        finally:
            await stream.aclose()

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if not isinstance(item, _End):
                yield index, item
            elif item.error is not None:
                raise item.error
            else:
                remaining -= 1
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def total_usage(finals: Sequence[RequestOutput]) -> Usage:
    usages = [final.usage for final in finals]
    return Usage.of(
        prompt_tokens=sum(u.prompt_tokens for u in usages),
        completion_tokens=sum(u.completion_tokens for u in usages),
        cached_tokens=sum(u.cached_tokens for u in usages),
    )


def finish_reason(output: CompletionOutput) -> FinishReason | None:
    if output.finish_reason is None:
        return None
    return "length" if output.finish_reason == "length" else "stop"


class ChunkEncoder(Protocol):
    def chunks(self, index: int, output: RequestOutput) -> list[BaseModel]: ...
    def usage_chunk(self, usage: Usage) -> BaseModel: ...


class OpenAIServing:
    """Runs OpenAI requests on an engine and shapes its outputs into OpenAI responses."""

    def __init__(
        self,
        engine: EngineClient,
        frontend: FrontEnd,
        served_model_name: str,
        tools: ToolSettings | None = None,
    ) -> None:
        self.engine = engine
        self.frontend = frontend
        self.model = served_model_name
        self.tools = tools or ToolSettings()

    def chat_render(self, request: ChatCompletionRequest, plan: ToolPlan | None) -> dict[str, Any]:
        model_template = self.frontend.renderer.tokenizer.chat_template
        return render_options(plan, request.messages, model_template)

    def assistant_message(
        self, output: CompletionOutput, plan: ToolPlan | None
    ) -> tuple[AssistantMessage, FinishReason]:
        """The message of a finished branch: its tool calls read back when the plan has a
        parser (finish_reason "tool_calls" when there are any), else its text."""
        reason = finish_reason(output) or "stop"
        parser = None if plan is None else plan.parser()
        if parser is None:
            return AssistantMessage(content=output.text), reason
        content, calls = calls_of(output.text, parser)
        if not calls:
            return AssistantMessage(content=content), reason
        return AssistantMessage(content=content, tool_calls=calls), (
            "tool_calls" if reason == "stop" else reason
        )

    def token_text(self, token_id: int) -> str:
        return self.frontend.token_text(token_id)

    async def start(
        self,
        prompts: Sequence[PromptInput],
        params: SamplingParams,
        rid: str,
        salt: bytes | None,
        meta: ResponseMeta | None = None,
        adapter: str | None = None,
        render: Mapping[str, Any] | None = None,
    ) -> list[Stream]:
        """Renders every prompt once, queues one engine request per prompt (for the LoRA
        `adapter`, None: the base model) and waits for each one's first output, so a refusal
        becomes an HTTP status before any byte is sent; `meta` learns which engine replica
        served the first prompt; `render` holds `chat_template` / `tools` for the renderer."""
        param = "prompt" if isinstance(prompts[0], str | Mapping) else "messages"
        try:
            requests = [
                await self.frontend.off_loop(
                    self.frontend.prepare,
                    prompt,
                    params,
                    request_id=rid if len(prompts) == 1 else f"{rid}-{i}",
                    tenant_salt=salt,
                    what=param,
                    adapter=adapter,
                    **(render or {}),
                )
                for i, prompt in enumerate(prompts)
            ]
        except RequestRejected as error:
            raise http_error(error, param) from None
        streams: list[Stream] = []
        try:
            for request in requests:
                stream = self.engine.generate(request)
                try:
                    first = await anext(stream)
                except ENGINE_ERRORS as error:
                    raise http_error(error) from None
                if meta is not None and meta.served_by is None:
                    meta.served_by = first.served_by
                streams.append(_chain(first, stream))
        except BaseException:
            for started in streams:
                await started.aclose()
            raise
        return streams

    async def finals(self, streams: list[Stream]) -> list[RequestOutput]:
        last: dict[int, RequestOutput] = {}
        try:
            async with contextlib.aclosing(merge_streams(streams)) as merged:
                async for index, output in merged:
                    last[index] = output
        except ENGINE_ERRORS as error:
            raise http_error(error) from None
        return [last[i] for i in range(len(streams))]

    async def events(
        self, streams: list[Stream], encoder: ChunkEncoder, include_usage: bool
    ) -> AsyncIterator[str]:
        """SSE text: the encoder's chunks, the usage chunk when asked, then `[DONE]`. An engine
        error mid-stream becomes an OpenAI error event (the client raises it), then `[DONE]`."""
        finals: list[RequestOutput] = []
        try:
            async with contextlib.aclosing(merge_streams(streams)) as merged:
                async for index, output in merged:
                    for chunk in encoder.chunks(index, output):
                        yield sse_event(chunk)
                    if output.finished:
                        finals.append(output)
        except ENGINE_ERRORS as error:
            yield sse_event(http_error(error).body())
            yield SSE_DONE  # as vLLM ends a failed stream: clients stop reading at [DONE]
            return
        if include_usage:
            yield sse_event(encoder.usage_chunk(total_usage(finals)))
        yield SSE_DONE

    def completion_logprobs(self, entries: list[Logprob], offset: int) -> CompletionLogprobs:
        tokens = [self.token_text(e.token_id) for e in entries]
        return CompletionLogprobs(
            tokens=tokens,
            token_logprobs=[e.logprob for e in entries],
            top_logprobs=[{self.token_text(t): lp for t, lp in e.top.items()} for e in entries],
            text_offset=list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=offset))
            if tokens
            else [],
        )

    def completion_choice(
        self, prompt_index: int, output: CompletionOutput, n: int, whole: bool
    ) -> CompletionChoice:
        """Choice `prompt_index * n + branch`; `whole` for the full text, else the delta."""
        offset = 0 if whole else len(output.text) - len(output.delta_text)
        logprobs = None
        if output.logprobs is not None:
            logprobs = self.completion_logprobs(new_logprobs(output, whole), offset)
        return CompletionChoice(
            index=prompt_index * n + output.index,
            text=output.text if whole else output.delta_text,
            logprobs=logprobs,
            finish_reason=finish_reason(output),
        )

    def chat_logprobs(self, entries: list[Logprob]) -> ChatLogprobs:
        def top(token_id: int, logprob: float) -> TopLogprob:
            text = self.token_text(token_id)
            return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))

        content = []
        for entry in entries:
            sampled = top(entry.token_id, entry.logprob if entry.logprob is not None else 0.0)
            alternatives = sorted(entry.top.items(), key=lambda kv: -kv[1])
            content.append(
                ChatTokenLogprob(
                    **sampled.model_dump(), top_logprobs=[top(t, lp) for t, lp in alternatives]
                )
            )
        return ChatLogprobs(content=content)

    async def completion(
        self,
        request: CompletionRequest,
        salt: bytes | None,
        meta: ResponseMeta | None = None,
        adapter: str | None = None,
    ) -> CompletionResponse:
        params = sampling_params(request.sampling_kwargs())
        rid = f"cmpl-{uuid.uuid4().hex}"
        prompts = [engine_prompt(p) for p in request.prompts()]
        finals = await self.finals(await self.start(prompts, params, rid, salt, meta, adapter))
        choices = [
            self.completion_choice(i, output, params.n, whole=True)
            for i, final in enumerate(finals)
            for output in final.outputs
        ]
        return CompletionResponse(
            id=rid,
            created=int(time.time()),
            model=adapter or self.model,
            choices=choices,
            usage=total_usage(finals),
        )

    async def stream_completion(
        self,
        request: CompletionRequest,
        salt: bytes | None,
        meta: ResponseMeta | None = None,
        adapter: str | None = None,
    ) -> AsyncIterator[str]:
        params = sampling_params(request.sampling_kwargs())
        rid = f"cmpl-{uuid.uuid4().hex}"
        prompts = [engine_prompt(p) for p in request.prompts()]
        streams = await self.start(prompts, params, rid, salt, meta, adapter)
        encoder = CompletionChunks(self, rid, adapter or self.model, params.n)
        return self.events(streams, encoder, request.include_usage)

    async def chat(
        self,
        request: ChatCompletionRequest,
        salt: bytes | None,
        meta: ResponseMeta | None = None,
        adapter: str | None = None,
    ) -> ChatCompletionResponse:
        plan = await self.frontend.off_loop(request.tool_plan, self.tools)
        params = sampling_params(request.sampling_kwargs(), plan)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        render = self.chat_render(request, plan)
        (final,) = await self.finals(
            await self.start([request.chat_messages()], params, rid, salt, meta, adapter, render)
        )
        choices = []
        for output in final.outputs:
            message, reason = self.assistant_message(output, plan)
            logprobs = None
            if output.logprobs is not None:
                logprobs = self.chat_logprobs(output.logprobs)
            choices.append(
                ChatChoice(
                    index=output.index, message=message, logprobs=logprobs, finish_reason=reason
                )
            )
        return ChatCompletionResponse(
            id=rid,
            created=int(time.time()),
            model=adapter or self.model,
            choices=choices,
            usage=total_usage([final]),
        )

    async def stream_chat(
        self,
        request: ChatCompletionRequest,
        salt: bytes | None,
        meta: ResponseMeta | None = None,
        adapter: str | None = None,
    ) -> AsyncIterator[str]:
        plan = await self.frontend.off_loop(request.tool_plan, self.tools)
        params = sampling_params(request.sampling_kwargs(), plan)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        render = self.chat_render(request, plan)
        streams = await self.start(
            [request.chat_messages()], params, rid, salt, meta, adapter, render
        )
        tool_stream = None if plan is None else plan.stream()
        encoder = ChatChunks(self, rid, adapter or self.model, tool_stream)
        return self.events(streams, encoder, request.include_usage)


class _StreamChunks:
    """What both chunk encoders share: the stream's id, model name (the adapter's for an adapter
    request) and creation time, the finish tracker, and the chunk model (`response_model`)
    every chunk and the final usage chunk are built as."""

    response_model: type[CompletionResponse] | type[ChatCompletionChunk]

    def __init__(self, serving: OpenAIServing, rid: str, model: str) -> None:
        self.serving, self.rid, self.model = serving, rid, model
        self.created = int(time.time())
        self.changes = FinishTracker()

    def _chunk(self, choices: list[Any], usage: Usage | None = None) -> BaseModel:
        return self.response_model(
            id=self.rid,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=usage,
        )

    def usage_chunk(self, usage: Usage) -> BaseModel:
        return self._chunk([], usage)


class CompletionChunks(_StreamChunks):
    """`text_completion` chunks, one choice each, as OpenAI streams them."""

    response_model = CompletionResponse

    def __init__(self, serving: OpenAIServing, rid: str, model: str, n: int) -> None:
        super().__init__(serving, rid, model)
        self.n = n

    def chunks(self, index: int, output: RequestOutput) -> list[BaseModel]:
        return [
            self._chunk([self.serving.completion_choice(index, branch, self.n, whole=False)])
            for branch in self.changes.changed(output, index)
        ]


class ChatChunks(_StreamChunks):
    """`chat.completion.chunk`s: a choice's first chunk carries the assistant role."""

    response_model = ChatCompletionChunk

    def __init__(
        self, serving: OpenAIServing, rid: str, model: str, tools: ToolStream | None = None
    ) -> None:
        super().__init__(serving, rid, model)
        self.started: set[int] = set()
        self.tools = tools

    def chunks(self, index: int, output: RequestOutput) -> list[BaseModel]:
        chunks = []
        for branch in self.changes.changed(output, index):
            role = None if branch.index in self.started else "assistant"
            self.started.add(branch.index)
            entries = new_logprobs(branch, whole=False)
            delta = ChatDelta(role=role, content=branch.delta_text)
            reason = finish_reason(branch)
            if self.tools is not None:  # tool calls are read back as the text grows
                content, calls = self.tools.update(branch.index, branch.text, branch.finished)
                delta = ChatDelta(role=role, content=content, tool_calls=calls)
                if reason == "stop" and self.tools.called(branch.index):
                    reason = "tool_calls"
                if content is None and calls is None and role is None and reason is None:
                    continue  # held back: the text may be the start of a call
            logprobs = self.serving.chat_logprobs(entries) if branch.logprobs is not None else None
            choice = ChatChunkChoice(
                index=branch.index, delta=delta, logprobs=logprobs, finish_reason=reason
            )
            chunks.append(self._chunk([choice]))
        return chunks
