"""The gRPC API (`pagedserve.v1.Generation`, `grpc.health.v1.Health`) over an `EngineClient`.

Protobuf lives at this edge only: requests become one `GenerateRequest` (rendered once by the
shared `FrontEnd`), engine outputs become `GenerateResponse` messages. The Serve replica
(cluster/serving/serve_app.py) delegates its gRPC methods here and turns a raised `GrpcAbort`
into the call's status.

Validation is HTTP's (cluster/serving/grpc_validation.py builds the same pydantic request
models); bytes that do not parse as the request message are INVALID_ARGUMENT (see
cluster/serving/grpc_wire.py, the servicer functions the proxy registers).

Status mapping: bad input (unset prompt, invalid sampling values, a prompt plus `max_tokens`
beyond the context, an adapter that cannot be loaded) -> INVALID_ARGUMENT; an unknown model or
adapter -> NOT_FOUND (HTTP's 404); admission queue full -> RESOURCE_EXHAUSTED;
a stopped engine -> UNAVAILABLE; a missing or unknown API key -> UNAUTHENTICATED. A cancelled
call closes the `generate` stream, which aborts the request in the engine and frees its blocks.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TypeVar

import grpc
from grpc_health.v1 import health_pb2
from ray.serve.grpc_util import RayServegRPCContext

from cluster.engine.client import ModelInfo
from cluster.engine.errors import RequestRejected
from cluster.engine.metrics import EngineMetrics
from cluster.engine.output_stream import BranchDelta, RequestDelta
from cluster.engine.outputs import Logprob
from cluster.engine.reasoning import ThinkingTags
from cluster.serving.error_map import ANSWERED, grpc_abort
from cluster.serving.frontend import FrontEnd, StreamTally
from cluster.serving.grpc_validation import (
    CorruptRequest,
    GrpcAbort,
    chat_request,
    parse_or_abort,
    requested_model,
    validate_generate,
)
from cluster.serving.reasoning_parsers import ReasoningStream
from cluster.serving.tool_calls import ToolSettings, ToolStream
from protos import generation_pb2 as pb

GRPC_SERVICE_NAME = "pagedserve.v1.Generation"
FINISH_REASONS = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}

Decode = Callable[[Sequence[int]], str]
MessageT = TypeVar("MessageT")


def _token_logprob(token_id: int, logprob: float | None, decode: Decode) -> pb.TokenLogprob:
    return pb.TokenLogprob(
        token_id=token_id, logprob=logprob if logprob is not None else 0.0, token=decode([token_id])
    )


def position_logprobs(entries: Sequence[Logprob], decode: Decode) -> list[pb.PositionLogprobs]:
    """The sampled token and its top alternatives (highest first) at each position."""
    return [
        pb.PositionLogprobs(
            sampled=_token_logprob(entry.token_id, entry.logprob, decode),
            top=[
                _token_logprob(token_id, logprob, decode)
                for token_id, logprob in sorted(entry.top.items(), key=lambda kv: -kv[1])
            ],
        )
        for entry in entries
    ]


def completion_delta(branch: BranchDelta, decode: Decode) -> pb.CompletionDelta:
    delta = pb.CompletionDelta(
        index=branch.index,
        text=branch.text,
        token_ids=branch.token_ids,
        finish_reason=FINISH_REASONS.get(branch.finish_reason or "", pb.FINISH_REASON_UNSPECIFIED),
    )
    if isinstance(branch.stop_reason, str):
        delta.stop_string = branch.stop_reason
    elif isinstance(branch.stop_reason, int):
        delta.stop_token_id = branch.stop_reason
    if branch.logprobs:
        delta.logprobs.extend(position_logprobs(branch.logprobs, decode))
    return delta


class GenerateStreamEncoder:
    """Turns one request's stream of `RequestDelta`s into `GenerateResponse` messages: a branch
    appears in a response when the engine's delta carries it (new tokens or text, or a finish,
    each reported once); the final response carries the usage, and the first response after
    the prompt's logprobs are complete carries them (when asked)."""

    def __init__(
        self,
        decode: Decode,
        tools: ToolStream | None = None,
        reasoning: ReasoningStream | None = None,
    ) -> None:
        """`reasoning`: the chat's thinking span goes to `reasoning_text`, never `text`."""
        self._decode = decode
        self._tally = StreamTally()
        self._tools = tools
        self._reasoning = reasoning or ReasoningStream(None, decode)

    def encode(self, delta: RequestDelta) -> pb.GenerateResponse | None:
        self._tally.add(delta)
        if delta.prompt_token_ids is not None:
            self._reasoning.start(delta.prompt_token_ids)
        response = pb.GenerateResponse(request_id=delta.request_id, finished=delta.finished)
        for branch in delta.branches:
            choice = completion_delta(branch, self._decode)
            piece = self._reasoning.piece(
                branch.index, branch.text, branch.finish_reason is not None
            )
            choice.text, choice.reasoning_text = piece.content, piece.reasoning
            if self._tools is not None:  # calls read from the answer's text as it grows
                finished = branch.finish_reason is not None
                _, calls = self._tools.update(branch.index, piece.content, finished)
                for call in calls or []:
                    choice.tool_calls.append(
                        pb.ToolCallDelta(
                            index=call.index or 0,
                            id=call.id or "",
                            name=call.function.name or "",
                            arguments=call.function.arguments or "",
                        )
                    )
                called = self._tools.called(branch.index)
                if choice.finish_reason == pb.FINISH_REASON_STOP and called:
                    choice.finish_reason = pb.FINISH_REASON_TOOL_CALLS
            response.choices.append(choice)
        if delta.prompt_logprobs is not None:
            entries = [entry for entry in delta.prompt_logprobs[1:] if entry is not None]
            response.prompt_logprobs.extend(position_logprobs(entries, self._decode))
        if delta.finished:
            tally = self._tally
            response.usage.CopyFrom(
                pb.Usage(
                    prompt_tokens=tally.prompt_tokens,
                    completion_tokens=tally.completion_tokens,
                    total_tokens=tally.prompt_tokens + tally.completion_tokens,
                    cached_prompt_tokens=tally.cached_tokens,
                )
            )
        if not response.choices and not delta.finished and not response.prompt_logprobs:
            return None
        return response


def cache_stats(metrics: EngineMetrics) -> pb.CacheStats:
    pressure = metrics.pressure
    return pb.CacheStats(
        tiers=[
            pb.CacheTier(
                name=name,
                total_blocks=tier.total,
                used_blocks=tier.used,
                free_blocks=tier.free,
                cached_blocks=tier.evictable_cached,
            )
            for name, tier in (("device", pressure.device), ("cpu", pressure.cpu))
        ],
        prefix_hit_rate=metrics.prefix_cache_hit_rate,
        preemptions_recompute=metrics.preemptions_recompute,
        preemptions_swap=metrics.preemptions_swap,
        blocks_swapped_out=pressure.swap_out_blocks,
        blocks_swapped_in=pressure.swap_in_blocks,
        running=metrics.num_running,
        waiting=metrics.num_waiting,
        swapped=metrics.num_swapped,
    )


def health_response(serving: bool) -> health_pb2.HealthCheckResponse:
    status = (
        health_pb2.HealthCheckResponse.SERVING
        if serving
        else (health_pb2.HealthCheckResponse.NOT_SERVING)
    )
    return health_pb2.HealthCheckResponse(status=status)


class GenerationRpc:
    """The four `Generation` RPCs over one engine serving one base model and its adapters."""

    def __init__(
        self,
        frontend: FrontEnd,
        tools: ToolSettings | None = None,
        reasoning: ThinkingTags | None = None,
    ) -> None:
        """`reasoning`: the `--reasoning-parser`'s tags (None: chat answers are not split)."""
        self.frontend = frontend
        self.adapters = frontend.adapters
        model_template = frontend.renderer.tokenizer.chat_template
        self.tools = (tools or ToolSettings()).for_template(model_template)
        self.reasoning = reasoning

    @property
    def served_model_name(self) -> str:
        return self.adapters.base_model

    def check_model(self, model: str) -> None:
        """For RPCs that only read the tokenizer (shared by every adapter): NOT_FOUND unless
        `model` is empty, the base model or an adapter in the cached view."""
        if model and not self.adapters.known(model):
            raise GrpcAbort(grpc.StatusCode.NOT_FOUND, f"The model `{model}` does not exist.")

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.frontend.renderer.decode(token_ids)

    def decode_keeping_special(self, token_ids: Sequence[int]) -> str:
        return self.frontend.renderer.decode(token_ids, skip_special_tokens=False)

    async def generate(
        self, request: pb.GenerateRequest, *, request_id: str, tenant_salt: bytes | None
    ) -> AsyncIterator[pb.GenerateResponse]:
        model = requested_model(request.model, request.adapter, self.served_model_name)
        checked = await self.frontend.off_loop(  # the HTTP checks, INVALID_ARGUMENT
            validate_generate,
            request,
            self.tools,
            self.frontend.renderer.tokenizer.chat_template,
            defaults=self.frontend.generation_defaults,
        )
        tools = None if checked.tools is None else checked.tools.stream()
        thinking = self.reasoning if request.WhichOneof("prompt") == "chat" else None
        reasoning = ReasoningStream(thinking, self.decode_keeping_special)
        encoder = GenerateStreamEncoder(self.decode, tools, reasoning)
        # Closing the engine stream is what aborts the request and frees its blocks, so a cancelled
        # call closes it at once here rather than whenever the generator is garbage-collected.
        try:
            submission = await self.frontend.submit(
                [checked.prompt],
                checked.params,
                model=model,
                request_id=request_id,
                tenant_salt=tenant_salt,
                render=checked.render,
                priority=checked.priority,
                thinking=thinking,
            )
            (stream,) = submission.streams
            async with contextlib.aclosing(stream):
                async for delta in stream:
                    response = encoder.encode(delta)
                    if response is not None:
                        yield response
        except ANSWERED as error:
            raise grpc_abort(error) from None

    def tokenize(self, request: pb.TokenizeRequest) -> pb.TokenizeResponse:
        self.check_model(request.model)
        renderer = self.frontend.renderer
        kind = request.WhichOneof("input")
        if kind == "text":
            ids = renderer.tokenizer.encode(
                request.text, add_special_tokens=request.add_special_tokens
            )
        elif kind == "chat":
            messages = chat_request(request.chat, {}).chat_messages()  # the HTTP checks
            try:
                ids = renderer.render_chat(messages).token_ids
            except RequestRejected as error:
                raise grpc_abort(error) from None
        else:
            raise GrpcAbort(grpc.StatusCode.INVALID_ARGUMENT, "set one of input.text, input.chat")
        return pb.TokenizeResponse(token_ids=ids, max_model_len=self.frontend.max_model_len)

    def model_info(self, model: ModelInfo, block_size: int, tp_size: int) -> pb.ModelInfo:
        return pb.ModelInfo(
            model=self.served_model_name,
            max_model_len=model.max_model_len,
            vocab_size=model.vocab_size,
            block_size=block_size,
            tensor_parallel_size=tp_size,
            dtype=model.dtype,
            kv_cache_dtype=model.dtype if model.kv_cache_dtype == "auto" else model.kv_cache_dtype,
            weights_digest=model.weights_digest,
            quantization=model.quantization,
            architecture=model.architecture,
        )


def metadata_value(metadata: Sequence[tuple[str, str]], name: str) -> str | None:
    return next((value for key, value in metadata if key.lower() == name), None)


def fail(context: RayServegRPCContext, error: GrpcAbort) -> GrpcAbort:
    """Sets the status on the call; Serve's proxy returns it when the method then raises."""
    context.set_code(error.code)
    context.set_details(error.details)
    return error


class GrpcMethods:
    """The gRPC methods of the application's ingress, named as the RPCs so Serve's gRPC proxy
    finds them: `pagedserve.v1.Generation` and `grpc.health.v1.Health`. The ingress class
    inherits them and provides `rpc` and the `grpc_*` hooks."""

    rpc: GenerationRpc

    async def grpc_serving(self) -> bool:
        """Whether the engines can serve (the ingress decides)."""
        raise NotImplementedError

    def grpc_tenant_salt(self, authorization: str | None) -> bytes | None:
        """The tenant salt for the call's `authorization` metadata; raises GrpcAbort
        (UNAUTHENTICATED) for a missing or unknown key when keys are configured."""
        raise NotImplementedError

    async def grpc_model_info(self) -> pb.ModelInfo:
        raise NotImplementedError

    async def grpc_cache_stats(self) -> pb.CacheStats:
        raise NotImplementedError

    def _salt(self, context: RayServegRPCContext) -> bytes | None:
        try:
            return self.grpc_tenant_salt(
                metadata_value(context.invocation_metadata(), "authorization")
            )
        except GrpcAbort as error:
            raise fail(context, error) from None

    def _message(
        self, request: MessageT | CorruptRequest, context: RayServegRPCContext
    ) -> MessageT:
        try:
            return parse_or_abort(request)
        except GrpcAbort as error:
            raise fail(context, error) from None

    async def Generate(
        self, request: pb.GenerateRequest | CorruptRequest, grpc_context: RayServegRPCContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        salt = self._salt(grpc_context)
        request = self._message(request, grpc_context)
        request_id = f"grpc-{uuid.uuid4().hex}"  # never the client's: ids must not collide
        responses = self.rpc.generate(request, request_id=request_id, tenant_salt=salt)
        try:
            async with contextlib.aclosing(responses):
                async for response in responses:
                    yield response
        except GrpcAbort as error:
            raise fail(grpc_context, error) from None

    async def Tokenize(
        self, request: pb.TokenizeRequest | CorruptRequest, grpc_context: RayServegRPCContext
    ) -> pb.TokenizeResponse:
        self._salt(grpc_context)
        message = self._message(request, grpc_context)
        try:
            return await self.rpc.frontend.off_loop(self.rpc.tokenize, message)
        except GrpcAbort as error:
            raise fail(grpc_context, error) from None

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest | CorruptRequest, grpc_context: RayServegRPCContext
    ) -> pb.ModelInfo:
        self._salt(grpc_context)
        self._message(request, grpc_context)
        return await self.grpc_model_info()

    async def GetCacheStats(
        self, request: pb.GetCacheStatsRequest | CorruptRequest, grpc_context: RayServegRPCContext
    ) -> pb.CacheStats:
        self._salt(grpc_context)
        self._message(request, grpc_context)
        return await self.grpc_cache_stats()

    async def Check(
        self,
        request: health_pb2.HealthCheckRequest | CorruptRequest,
        grpc_context: RayServegRPCContext,
    ) -> health_pb2.HealthCheckResponse:
        request = self._message(request, grpc_context)
        if request.service not in ("", GRPC_SERVICE_NAME):
            error = GrpcAbort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
            raise fail(grpc_context, error)
        return health_response(serving=await self.grpc_serving())

    async def Watch(
        self,
        request: health_pb2.HealthCheckRequest | CorruptRequest,
        grpc_context: RayServegRPCContext,
    ) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        """Reports the current status once (a replica that stops serving goes away)."""
        yield await self.Check(request, grpc_context)
