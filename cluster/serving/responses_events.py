"""The Responses API's output: response objects, output items and the typed stream events, as
OpenAI defines them.

`ResponseEncoder` turns `chat_bridge` pieces into the event sequence: `response.created`,
`response.in_progress`, then per output item `response.output_item.added`, for a reasoning item
(the thinking span, with `--reasoning-parser`; no summary: the model writes none)
`response.content_part.added`, `response.reasoning_text.delta`... `response.reasoning_text.done`,
`response.content_part.done`, for a message `response.content_part.added`,
`response.output_text.delta`... `response.output_text.done`, `response.content_part.done`, for a
function call `response.function_call_arguments.delta`...
`response.function_call_arguments.done`, then `response.output_item.done`; last
`response.completed` (or `response.incomplete` when the output limit cut it short).

Invariants: every event carries `sequence_number`, counting from 0 without gaps; an item's
`output_index` is its position in the final `output`; each item is added once and done once,
before the next one is added; the final response's output is exactly the items streamed.
"""

from __future__ import annotations

import copy
import time
import uuid
from typing import Any

from cluster.engine.sampling_params import SamplingParams
from cluster.serving.chat_bridge import (
    CallArguments,
    CallStart,
    Finished,
    Piece,
    ReasoningPiece,
    Started,
    TextPiece,
)
from cluster.serving.openai_protocol import AssistantMessage, FinishReason
from cluster.serving.responses_requests import ResponsesRequest


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage_of(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
        "output_tokens": completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + completion_tokens,
    }


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def reasoning_item(text: str | None, status: str = "completed") -> dict[str, Any]:
    """The thinking span as a `reasoning` item: its text as `content`, no `summary`."""
    return {
        "type": "reasoning",
        "id": new_id("rs"),
        "status": status,
        "summary": [],
        "content": [] if text is None else [reasoning_part(text)],
    }


def message_item(text: str | None, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "message",
        "id": new_id("msg"),
        "status": status,
        "role": "assistant",
        "content": [] if text is None else [text_part(text)],
    }


def call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": new_id("fc"),
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def output_of(message: AssistantMessage) -> list[dict[str, Any]]:
    """A finished chat answer as Responses output items: its reasoning (when the parser found
    a non-empty thinking span, as a stream would show it), its text, then its calls."""
    items = []
    if message.reasoning_content:
        items.append(reasoning_item(message.reasoning_content))
    if message.content:
        items.append(message_item(message.content))
    for call in message.tool_calls or []:
        assert call.id is not None and call.function.name is not None
        items.append(call_item(call.id, call.function.name, call.function.arguments or ""))
    return items


def response_object(
    request: ResponsesRequest,
    params: SamplingParams,
    *,
    response_id: str,
    created_at: int,
    model: str,
    output: list[dict[str, Any]],
    finish: FinishReason | None,
    usage: dict[str, Any] | None,
) -> dict[str, Any]:
    """The response object: `in_progress` while `finish` is None, `incomplete` (reason
    `max_output_tokens`) when the limit cut the output, else `completed`. `temperature` and
    `top_p` are the ones the engine runs with (`params`: a field the request left unset has
    the model's generation default)."""
    status = "in_progress" if finish is None else "completed"
    incomplete = None
    if finish == "length":
        status, incomplete = "incomplete", {"reason": "max_output_tokens"}
    text_format = request.text.format if request.text is not None else None
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "error": None,
        "incomplete_details": incomplete,
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "model": model,
        "output": output,
        "parallel_tool_calls": (
            True if request.parallel_tool_calls is None else request.parallel_tool_calls
        ),
        "previous_response_id": request.previous_response_id,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "tool_choice": (
            request.tool_choice.model_dump()
            if request.tool_choice is not None and not isinstance(request.tool_choice, str)
            else request.tool_choice or "auto"
        ),
        "tools": [tool.model_dump(exclude_none=True) for tool in request.function_tools()],
        "text": {
            "format": (
                {"type": "text"}
                if text_format is None
                else text_format.model_dump(by_alias=True, exclude_none=True)
            )
        },
        "truncation": "disabled",
        "store": request.store,
        "metadata": request.metadata or {},
        "user": request.user,
        "usage": usage,
    }


class ResponseEncoder:
    """One streamed response's events (see the module doc); `output` holds the items so far."""

    def __init__(
        self, request: ResponsesRequest, params: SamplingParams, response_id: str, model: str
    ) -> None:
        self.request = request
        self.params = params
        self.response_id = response_id
        self.model = model
        self.created_at = int(time.time())
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self._open: int | None = None
        """The output index of the item still growing, if any."""
        self._calls: dict[int, int] = {}
        """A call's index among the calls -> its output index."""
        self.response_body: dict[str, Any] = {}
        """The final response, once `finish` ran."""

    def response(self, finish: FinishReason | None, usage: dict[str, Any] | None = None) -> dict:
        return response_object(
            self.request,
            self.params,
            response_id=self.response_id,
            created_at=self.created_at,
            model=self.model,
            output=copy.deepcopy(self.output),
            finish=finish,
            usage=usage,
        )

    def start(self) -> list[dict[str, Any]]:
        snapshot = self.response(None)
        return [
            self._event("response.created", response=snapshot),
            self._event("response.in_progress", response=snapshot),
        ]

    def feed(self, piece: Piece) -> list[dict[str, Any]]:
        if isinstance(piece, Started):
            return []
        if isinstance(piece, ReasoningPiece):
            return self._grow("reasoning", piece.text)
        if isinstance(piece, TextPiece):
            return self._grow("message", piece.text)
        if isinstance(piece, CallStart):
            events = self._close()
            self._calls[piece.index] = len(self.output)
            self._open = len(self.output)
            self.output.append(call_item(piece.call_id, piece.name, "", status="in_progress"))
            return [*events, self._added()]
        if isinstance(piece, CallArguments):
            index = self._calls[piece.index]
            self.output[index]["arguments"] += piece.text
            item_id = self.output[index]["id"]
            return [
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=item_id,
                    output_index=index,
                    delta=piece.text,
                )
            ]
        return self.finish(piece)

    def finish(self, finished: Finished) -> list[dict[str, Any]]:
        events = self._close()
        usage = usage_of(finished.prompt_tokens, finished.completion_tokens, finished.cached_tokens)
        final = self.response(finished.reason, usage)
        self.response_body = final
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        return [*events, self._event(kind, response=final)]

    def _grow(self, kind: str, text: str) -> list[dict[str, Any]]:
        """`text` added to the growing `reasoning` or `message` item (opened first when the
        growing item is another)."""
        events = []
        if self._open is None or self.output[self._open]["type"] != kind:
            events = self._close()
            self._open = len(self.output)
            if kind == "reasoning":
                item, part = reasoning_item(None, "in_progress"), reasoning_part("")
            else:
                item, part = message_item(None, "in_progress"), text_part("")
            self.output.append(item)
            events.append(self._added())
            item["content"].append(part)
            events.append(self._part_event("response.content_part.added", part))
        item = self.output[self._open]
        item["content"][0]["text"] += text
        fields: dict[str, Any] = {
            "item_id": item["id"],
            "output_index": self._open,
            "content_index": 0,
            "delta": text,
        }
        if kind == "reasoning":
            events.append(self._event("response.reasoning_text.delta", **fields))
        else:
            events.append(self._event("response.output_text.delta", **fields, logprobs=[]))
        return events

    def _close(self) -> list[dict[str, Any]]:
        """Ends the growing item: its text or arguments done, then the item done."""
        if self._open is None:
            return []
        index, self._open = self._open, None
        item = self.output[index]
        item["status"] = "completed"
        if item["type"] in ("message", "reasoning"):
            part = item["content"][0]
            text_done = (
                self._event(
                    "response.output_text.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    text=part["text"],
                    logprobs=[],
                )
                if item["type"] == "message"
                else self._event(
                    "response.reasoning_text.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    text=part["text"],
                )
            )
            events = [text_done, self._part_event("response.content_part.done", part, index)]
        else:
            events = [
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            ]
        events.append(self._event("response.output_item.done", output_index=index, item=item))
        return events

    def _added(self) -> dict[str, Any]:
        index = len(self.output) - 1
        return self._event(
            "response.output_item.added", output_index=index, item=self.output[index]
        )

    def _part_event(self, kind: str, part: dict[str, Any], index: int | None = None) -> dict:
        index = self._open if index is None else index
        assert index is not None
        item_id = self.output[index]["id"]
        return self._event(kind, item_id=item_id, output_index=index, content_index=0, part=part)

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **copy.deepcopy(fields)}
        self.sequence += 1
        return event
