"""OpenAI-compatible serving over an `EngineClient`: admits completions and chat completions,
shapes whole engine outputs into OpenAI responses and writes streamed ones as server-sent events
(their chunks are `openai_chunks`'; merging and summing engine streams is `delta_streams`').

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

import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cluster.engine.generate_request import PromptInput
from cluster.engine.output_stream import OutputAccumulator
from cluster.engine.outputs import CompletionOutput, Logprob, RequestOutput
from cluster.engine.reasoning import ThinkingTags
from cluster.engine.sampling_params import SamplingParams
from cluster.serving.delta_streams import finish_reason, merge_streams, total_usage, whole_usage
from cluster.serving.error_map import ANSWERED, http_error
from cluster.serving.frontend import DeltaStream, FrontEnd, StreamTally, Submission
from cluster.serving.logprob_shapes import (
    chat_logprobs,
    completion_logprobs,
    echoed,
    vllm_prompt_logprobs,
)
from cluster.serving.openai_chunks import ChatChunks, ChunkEncoder, CompletionChunks
from cluster.serving.openai_protocol import (
    SSE_DONE,
    AssistantMessage,
    ChatChoice,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionResponse,
    FinishReason,
    PromptLogprobs,
    invalid_request,
    sse_event,
)
from cluster.serving.openai_requests import (
    ChatCompletionRequest,
    CompletionRequest,
    Prompt,
    SamplingKwargs,
)
from cluster.serving.reasoning_parsers import ReasoningStream, reasoning_of
from cluster.serving.tool_calls import (
    ToolPlan,
    ToolSettings,
    calls_of,
    render_options,
)


def engine_prompt(prompt: Prompt) -> PromptInput:
    """A completions prompt as the engine takes it (token ids skip the tokenizer)."""
    return prompt if isinstance(prompt, str) else {"prompt_token_ids": list(prompt)}


def sampling_params(kwargs: SamplingKwargs, tools: ToolPlan | None = None) -> SamplingParams:
    """The engine's parameters; a tool plan's grammar (required or named choice) constrains
    the output."""
    constraint = None if tools is None else tools.constraint()
    if constraint is not None:
        kwargs = SamplingKwargs(**{**kwargs, "structured_outputs": constraint})
    try:
        return SamplingParams(**kwargs)
    except ValueError as error:
        raise invalid_request(str(error)) from None


@dataclass
class ResponseMeta:
    """What a route learns about a response besides its body: the engine replica that served
    it (None in process), for the `x-pagedserve-replica` header."""

    served_by: str | None = None


class OpenAIServing:
    """Runs OpenAI requests on an engine and shapes its outputs into OpenAI responses."""

    def __init__(
        self,
        frontend: FrontEnd,
        served_model_name: str,
        tools: ToolSettings | None = None,
        reasoning: ThinkingTags | None = None,
    ) -> None:
        """`reasoning`: the `--reasoning-parser`'s tags (None: chat answers are not split)."""
        self.frontend = frontend
        self.model = served_model_name
        model_template = frontend.renderer.tokenizer.chat_template
        self.tools = (tools or ToolSettings()).for_template(model_template)
        self.reasoning = reasoning

    def sampling_params(
        self, request: CompletionRequest | ChatCompletionRequest, tools: ToolPlan | None = None
    ) -> SamplingParams:
        """The engine's parameters of `request` (fields it leaves unset take the model's
        generation defaults, which the engine read), constrained by `tools`' grammar."""
        return sampling_params(request.sampling_kwargs(self.frontend.generation_defaults), tools)

    async def submit_chat(
        self,
        request: ChatCompletionRequest,
        plan: ToolPlan | None,
        params: SamplingParams,
        rid: str,
        salt: bytes | None,
        meta: ResponseMeta | None,
    ) -> Submission:
        """A chat's one submission: rendered as `chat_render` says, the reasoning parser's tags
        attached (a constraint waits for the thinking span's end)."""
        return await self.submit(
            request.model,
            [request.chat_messages()],
            params,
            rid,
            salt,
            meta,
            self.chat_render(request, plan),
            request.priority,
            self.reasoning,
        )

    def chat_render(self, request: ChatCompletionRequest, plan: ToolPlan | None) -> dict[str, Any]:
        """How a chat renders: with its tools (through a template that supports them) and its
        `chat_template_kwargs`."""
        model_template = self.frontend.renderer.tokenizer.chat_template
        render = render_options(plan, request.messages, model_template)
        if request.chat_template_kwargs:
            render["chat_template_kwargs"] = request.chat_template_kwargs
        return render

    def assistant_message(
        self, output: CompletionOutput, plan: ToolPlan | None, prompt_token_ids: list[int]
    ) -> tuple[AssistantMessage, FinishReason]:
        """The message of a finished branch: the thinking span split off first (with a
        reasoning parser), then the tool calls read back from the rest when the plan has any
        (finish_reason "tool_calls" when it stopped by itself), else the rest as text."""
        reason = finish_reason(output) or "stop"
        reasoning, text = reasoning_of(output.text, self.reasoning, prompt_token_ids, self.decode)
        plain = text or (None if reasoning is not None else text)
        if plan is None:
            return AssistantMessage(content=plain, reasoning_content=reasoning), reason
        content, calls = calls_of(text, plan)
        if not calls:
            return AssistantMessage(content=plain, reasoning_content=reasoning), reason
        message = AssistantMessage(content=content, reasoning_content=reasoning, tool_calls=calls)
        return message, ("tool_calls" if reason == "stop" else reason)

    def token_text(self, token_id: int) -> str:
        return self.frontend.token_text(token_id)

    def decode(self, token_ids: list[int]) -> str:
        """Token ids as text, special tokens kept (a prompt given as ids, echoed)."""
        return self.frontend.renderer.decode(token_ids, skip_special_tokens=False)

    async def submit(
        self,
        model: str,
        prompts: Sequence[PromptInput],
        params: SamplingParams,
        rid: str,
        salt: bytes | None,
        meta: ResponseMeta | None,
        render: Mapping[str, Any] | None = None,
        priority: int = 0,
        thinking: ThinkingTags | None = None,
    ) -> Submission:
        """`FrontEnd.submit`, its refusals raised as `OpenAIError` before any byte is sent;
        `meta` learns which engine replica served the first prompt; `render` holds
        `chat_template` / `tools` / `chat_template_kwargs` for the chat renderer; `priority`
        the request's scheduling priority; `thinking` the reasoning parser's tags."""
        param = "prompt" if isinstance(prompts[0], str | Mapping) else "messages"
        try:
            submission = await self.frontend.submit(
                prompts,
                params,
                model=model,
                request_id=rid,
                tenant_salt=salt,
                what=param,
                render=render,
                priority=priority,
                thinking=thinking,
            )
        except ANSWERED as error:
            raise http_error(error, param) from None
        if meta is not None:
            meta.served_by = submission.served_by
        return submission

    async def finals(self, streams: list[DeltaStream]) -> list[RequestOutput]:
        """Each stream's whole answer (the one place deltas are folded)."""
        folded = [OutputAccumulator() for _ in streams]
        last: dict[int, RequestOutput] = {}
        try:
            async with contextlib.aclosing(merge_streams(streams)) as merged:
                async for index, delta in merged:
                    last[index] = folded[index].apply(delta)
        except ANSWERED as error:
            raise http_error(error) from None
        return [last[i] for i in range(len(streams))]

    async def events(
        self, streams: list[DeltaStream], encoder: ChunkEncoder, include_usage: bool
    ) -> AsyncIterator[str]:
        """SSE text: the encoder's chunks, the usage chunk when asked, then `[DONE]`. An engine
        error mid-stream becomes an OpenAI error event (the client raises it), then `[DONE]`."""
        tallies = [StreamTally() for _ in streams]
        try:
            async with contextlib.aclosing(merge_streams(streams)) as merged:
                async for index, delta in merged:
                    tallies[index].add(delta)
                    for chunk in encoder.chunks(index, delta):
                        yield sse_event(chunk)
        except ANSWERED as error:
            yield sse_event(http_error(error).body())
            yield SSE_DONE  # as vLLM ends a failed stream: clients stop reading at [DONE]
            return
        if include_usage:
            yield sse_event(encoder.usage_chunk(total_usage(tallies)))
        yield SSE_DONE

    def completion_choice(
        self,
        index: int,
        text: str,
        logprobs: list[Logprob] | None,
        offset: int,
        finish: FinishReason | None,
        prompt_logprobs: PromptLogprobs | None = None,
    ) -> CompletionChoice:
        return CompletionChoice(
            index=index,
            text=text,
            logprobs=(
                None if logprobs is None else completion_logprobs(logprobs, offset, self.token_text)
            ),
            finish_reason=finish,
            prompt_logprobs=prompt_logprobs,
        )

    async def completion(
        self, request: CompletionRequest, salt: bytes | None, meta: ResponseMeta | None = None
    ) -> CompletionResponse:
        params = self.sampling_params(request)
        rid = f"cmpl-{uuid.uuid4().hex}"
        prompts = [engine_prompt(p) for p in request.prompts()]
        submission = await self.submit(
            request.model, prompts, params, rid, salt, meta, priority=request.priority
        )
        finals = await self.finals(submission.streams)
        choices = []
        for i, final in enumerate(finals):
            echoed_text, echoed_logprobs = (
                echoed(final, self.decode, request.logprobs) if request.echo else ("", [])
            )
            shown_prompt = None
            if request.prompt_logprobs is not None:
                shown_prompt = vllm_prompt_logprobs(final, self.token_text, request.prompt_logprobs)
            for output in final.outputs:
                logprobs = output.logprobs
                if logprobs is not None and request.echo:
                    logprobs = echoed_logprobs + logprobs
                choices.append(
                    self.completion_choice(
                        i * params.n + output.index,
                        echoed_text + output.text,
                        logprobs,
                        0,
                        finish_reason(output),
                        shown_prompt,
                    )
                )
        return CompletionResponse(
            id=rid,
            created=int(time.time()),
            model=submission.adapter or self.model,
            choices=choices,
            usage=whole_usage(finals),
        )

    async def stream_completion(
        self, request: CompletionRequest, salt: bytes | None, meta: ResponseMeta | None = None
    ) -> AsyncIterator[str]:
        params = self.sampling_params(request)
        rid = f"cmpl-{uuid.uuid4().hex}"
        prompts = [engine_prompt(p) for p in request.prompts()]
        submission = await self.submit(
            request.model, prompts, params, rid, salt, meta, priority=request.priority
        )
        encoder = CompletionChunks(self, rid, submission.adapter or self.model, params.n)
        return self.events(submission.streams, encoder, request.include_usage)

    async def chat(
        self, request: ChatCompletionRequest, salt: bytes | None, meta: ResponseMeta | None = None
    ) -> ChatCompletionResponse:
        plan = await self.frontend.off_loop(request.tool_plan, self.tools)
        params = self.sampling_params(request, plan)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        submission = await self.submit_chat(request, plan, params, rid, salt, meta)
        (final,) = await self.finals(submission.streams)
        choices = []
        for output in final.outputs:
            message, reason = self.assistant_message(output, plan, final.prompt_token_ids)
            logprobs = None
            if output.logprobs is not None:
                logprobs = chat_logprobs(output.logprobs, self.token_text)
            choices.append(
                ChatChoice(
                    index=output.index, message=message, logprobs=logprobs, finish_reason=reason
                )
            )
        return ChatCompletionResponse(
            id=rid,
            created=int(time.time()),
            model=submission.adapter or self.model,
            choices=choices,
            usage=whole_usage([final]),
            prompt_logprobs=(
                None
                if request.prompt_logprobs is None
                else vllm_prompt_logprobs(final, self.token_text, request.prompt_logprobs)
            ),
        )

    async def stream_chat(
        self, request: ChatCompletionRequest, salt: bytes | None, meta: ResponseMeta | None = None
    ) -> AsyncIterator[str]:
        plan = await self.frontend.off_loop(request.tool_plan, self.tools)
        params = self.sampling_params(request, plan)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        submission = await self.submit_chat(request, plan, params, rid, salt, meta)
        tool_stream = None if plan is None else plan.stream()
        reasoning = ReasoningStream(self.reasoning, self.decode)
        encoder = ChatChunks(self, rid, submission.adapter or self.model, tool_stream, reasoning)
        return self.events(submission.streams, encoder, request.include_usage)
