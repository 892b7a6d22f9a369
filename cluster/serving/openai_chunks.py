"""Streamed completions and chat completions as OpenAI's chunks: one encoder per stream turns
each engine delta into `text_completion` / `chat.completion.chunk` objects (`OpenAIServing.events`
writes them as server-sent events).

Invariants: every branch of a delta is one chunk (the engine puts a branch in a delta only with
something new or a finish not reported yet), so each choice's finish is reported exactly once;
a chat choice's first chunk carries the assistant role; text that may still be a reasoning tag
or the start of a tool call is held back until it is known.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Protocol

from pydantic import BaseModel

from cluster.engine.output_stream import RequestDelta
from cluster.serving.delta_streams import finish_reason
from cluster.serving.frontend import StreamTally
from cluster.serving.logprob_shapes import chat_logprobs
from cluster.serving.openai_protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    CompletionResponse,
    Usage,
)
from cluster.serving.reasoning_parsers import ReasoningStream
from cluster.serving.tool_calls import ToolStream

if TYPE_CHECKING:
    from cluster.serving.openai_serving import OpenAIServing


class ChunkEncoder(Protocol):
    def chunks(self, index: int, delta: RequestDelta) -> list[BaseModel]: ...
    def usage_chunk(self, usage: Usage) -> BaseModel: ...


class _StreamChunks:
    """What both chunk encoders share: the stream's id, model name (the adapter's for an adapter
    request) and creation time, and the chunk model (`response_model`) every chunk and the
    final usage chunk are built as. Every branch of a delta is a chunk: the engine puts a
    branch in a delta only with something new or a finish not reported yet."""

    response_model: type[CompletionResponse] | type[ChatCompletionChunk]

    def __init__(self, serving: OpenAIServing, rid: str, model: str) -> None:
        self.serving, self.rid, self.model = serving, rid, model
        self.created = int(time.time())

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

        self.tallies: dict[int, StreamTally] = {}

    def chunks(self, index: int, delta: RequestDelta) -> list[BaseModel]:
        tally = self.tallies.setdefault(index, StreamTally())
        serving = self.serving
        return [
            self._chunk(
                [
                    serving.completion_choice(
                        index * self.n + branch.index,
                        branch.text,
                        branch.logprobs,
                        tally.text_offset(branch),
                        finish_reason(branch),
                    )
                ]
            )
            for branch in delta.branches
        ]


class ChatChunks(_StreamChunks):
    """`chat.completion.chunk`s: a choice's first chunk carries the assistant role."""

    response_model = ChatCompletionChunk

    def __init__(
        self,
        serving: OpenAIServing,
        rid: str,
        model: str,
        tools: ToolStream | None = None,
        reasoning: ReasoningStream | None = None,
    ) -> None:
        super().__init__(serving, rid, model)
        self.started: set[int] = set()
        self.tools = tools
        self.reasoning = reasoning or ReasoningStream(None, serving.decode)

    def chunks(self, index: int, delta: RequestDelta) -> list[BaseModel]:
        chunks = []
        if delta.prompt_token_ids is not None:
            self.reasoning.start(delta.prompt_token_ids)
        for branch in delta.branches:
            role = None if branch.index in self.started else "assistant"
            self.started.add(branch.index)
            logprobs = None
            if branch.logprobs is not None:
                logprobs = chat_logprobs(branch.logprobs, self.serving.token_text)
            reason = finish_reason(branch)
            piece = self.reasoning.piece(branch.index, branch.text, reason is not None)
            thought = piece.reasoning or None
            delta_out = ChatDelta(
                role=role,
                content=None if thought and not piece.content else piece.content,
                reasoning_content=thought,
            )
            if self.tools is not None:  # tool calls are read back as the content grows
                content, calls = self.tools.update(branch.index, piece.content, reason is not None)
                delta_out = ChatDelta(
                    role=role, content=content, reasoning_content=thought, tool_calls=calls
                )
                if reason == "stop" and self.tools.called(branch.index):
                    reason = "tool_calls"
                if not (content or calls or role or reason or thought):
                    continue  # held back: the text may be the start of a call
            elif self.reasoning.active and not (
                piece.content or thought or role or reason or logprobs
            ):
                continue  # held back: the text may be the start of a reasoning tag
            choice = ChatChunkChoice(
                index=branch.index, delta=delta_out, logprobs=logprobs, finish_reason=reason
            )
            chunks.append(self._chunk([choice]))
        return chunks
