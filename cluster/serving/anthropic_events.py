"""Anthropic's Messages output: the message object, its content blocks, `stop_reason`, usage,
error bodies and the stream's events.

`MessageEncoder` turns `chat_bridge` pieces into Anthropic's event sequence: `message_start`
(with the prompt's usage) and `ping`, then per content block `content_block_start`,
`content_block_delta` (`thinking_delta` for the thinking span with `--reasoning-parser`, then
`signature_delta` with an empty signature: nothing signs it; `text_delta` for text,
`input_json_delta` for a tool call's input) and `content_block_stop`; last `message_delta`
(`stop_reason`, `stop_sequence`, the output usage) and `message_stop`.

Usage follows Anthropic: `input_tokens` are the prompt tokens not read from the prefix cache,
`cache_read_input_tokens` those that were (their sum is the prompt).

Invariants: a block's `index` is its position in the final `content`; each block is started
once and stopped once, before the next one starts.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from cluster.serving.chat_bridge import (
    CallArguments,
    CallStart,
    Finished,
    Piece,
    ReasoningPiece,
    Started,
    TextPiece,
)
from cluster.serving.openai_protocol import AssistantMessage, FinishReason, OpenAIError

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
"""Anthropic's error `type` for an HTTP status (anything else: `api_error`)."""


def error_body(error: OpenAIError) -> dict[str, Any]:
    """`error` in Anthropic's error shape (the message names the field)."""
    kind = ERROR_TYPES.get(error.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def stop_reason_of(reason: FinishReason, stop_sequence: str | None) -> str:
    if reason == "length":
        return "max_tokens"
    if reason == "tool_calls":
        return "tool_use"
    return "stop_sequence" if stop_sequence is not None else "end_turn"


def usage_of(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, int]:
    return {
        "input_tokens": prompt_tokens - cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached_tokens,
        "output_tokens": completion_tokens,
    }


def thinking_block(text: str) -> dict[str, Any]:
    """The thinking span as a `thinking` block; its signature is empty (nothing signs it)."""
    return {"type": "thinking", "thinking": text, "signature": ""}


def content_of(message: AssistantMessage) -> list[dict[str, Any]]:
    """A finished chat answer as content blocks: its thinking (when the parser found a
    non-empty thinking span, as a stream would show it), its text, then its calls."""
    blocks: list[dict[str, Any]] = []
    if message.reasoning_content:
        blocks.append(thinking_block(message.reasoning_content))
    if message.content:
        blocks.append({"type": "text", "text": message.content})
    for call in message.tool_calls or []:
        blocks.append(
            {
                "type": "tool_use",
                "id": call.id,
                "name": call.function.name,
                "input": json.loads(call.function.arguments or "{}"),
            }
        )
    return blocks


def message_object(
    message_id: str,
    model: str,
    content: list[dict[str, Any]],
    stop_reason: str | None,
    stop_sequence: str | None,
    usage: dict[str, int],
) -> dict[str, Any]:
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": usage,
    }


class MessageEncoder:
    """One streamed message's events (see the module doc)."""

    def __init__(self, message_id: str, model: str) -> None:
        self.message_id = message_id
        self.model = model
        self.blocks = 0
        self._open: str | None = None
        """The type of the block still growing (`thinking`, `text` or `tool_use`), if any."""

    def feed(self, piece: Piece) -> list[dict[str, Any]]:
        if isinstance(piece, Started):
            usage = usage_of(piece.prompt_tokens, 0, piece.cached_tokens)
            message = message_object(self.message_id, self.model, [], None, None, usage)
            return [{"type": "message_start", "message": message}, {"type": "ping"}]
        if isinstance(piece, ReasoningPiece):
            events = []
            if self._open != "thinking":
                events = self._start(thinking_block(""))
            return [*events, self._delta({"type": "thinking_delta", "thinking": piece.text})]
        if isinstance(piece, TextPiece):
            events = []
            if self._open != "text":
                events = self._start({"type": "text", "text": ""})
            delta = {"type": "text_delta", "text": piece.text}
            return [*events, self._delta(delta)]
        if isinstance(piece, CallStart):
            block = {"type": "tool_use", "id": piece.call_id, "name": piece.name, "input": {}}
            return self._start(block)
        if isinstance(piece, CallArguments):
            return [self._delta({"type": "input_json_delta", "partial_json": piece.text})]
        return self.finish(piece)

    def finish(self, finished: Finished) -> list[dict[str, Any]]:
        usage = usage_of(finished.prompt_tokens, finished.completion_tokens, finished.cached_tokens)
        delta = {
            "stop_reason": stop_reason_of(finished.reason, finished.stop_sequence),
            "stop_sequence": finished.stop_sequence,
        }
        return [
            *self._stop(),
            {"type": "message_delta", "delta": delta, "usage": usage},
            {"type": "message_stop"},
        ]

    def _start(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._stop()
        self._open = block["type"]
        events.append({"type": "content_block_start", "index": self.blocks, "content_block": block})
        return events

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self.blocks, "delta": delta}

    def _stop(self) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        events = []
        if self._open == "thinking":  # as Anthropic ends a thinking block
            events.append(self._delta({"type": "signature_delta", "signature": ""}))
        self._open = None
        self.blocks += 1
        return [*events, {"type": "content_block_stop", "index": self.blocks - 1}]
