"""`POST /v1/messages` and `POST /v1/messages/count_tokens` requests as Anthropic defines them,
validated at the edge and translated into chat-completions fields (`chat_bridge` runs those).

- `system`: text or text blocks, the system message.
- `messages`: `user` / `assistant` turns whose content is text or blocks: `text`, `tool_use`
  (an assistant's call: `id`, `name`, `input`), `thinking` / `redacted_thinking` (an
  assistant's earlier thinking, accepted and left out of the prompt, as Anthropic drops earlier
  turns' thinking) and `tool_result` (`tool_use_id`, `content` as text or text blocks); a user
  turn's results become tool messages before its text.
- `tools` (`name`, `description`, `input_schema`) and `tool_choice`: `auto`, `any` (a call is
  required), `tool` (that function), `none`; `disable_parallel_tool_use`.
- `max_tokens` (required on `/v1/messages`), `stop_sequences`, `temperature` (0 to 1),
  `top_p`, `top_k`, `stream`, `metadata` (ignored).

Invariants: types are strict, unknown fields ignored; every refusal is a 400 naming the field
as Anthropic spells it (`max_tokens`, `messages[1].content[0].type`, `tools[0].input_schema`,
`stop_sequences`), which the route writes in Anthropic's error body.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from cluster.serving.chat_bridge import ParamNames, validated_part
from cluster.serving.openai_protocol import invalid_request, parse_object

ANTHROPIC_NAMES = ParamNames(
    (
        (r"^max_completion_tokens", "max_tokens"),
        (r"^stop", "stop_sequences"),
        (r"^tools\[(\d+)\]\.function\.parameters", r"tools[\1].input_schema"),
        (r"^tools\[(\d+)\]\.function\.", r"tools[\1]."),
    )
)
"""Chat field names as Anthropic's API spells them, for errors."""


class _Edge(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextBlock(_Edge):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Edge):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Edge):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool = False

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(block.text for block in self.content)


class ThinkingBlock(_Edge):
    """An assistant's earlier thinking (`thinking`, or `redacted_thinking` with its `data`)."""

    type: Literal["thinking", "redacted_thinking"]
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None


Block = TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock
BLOCK_MODELS: dict[str, type[Block]] = {
    "text": TextBlock,
    "tool_use": ToolUseBlock,
    "tool_result": ToolResultBlock,
    "thinking": ThinkingBlock,
    "redacted_thinking": ThinkingBlock,
}


class AnthropicMessage(_Edge):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class AnthropicTool(_Edge):
    type: Literal["custom"] | None = None
    name: str
    description: str | None = None
    input_schema: dict[str, Any]


class AnthropicToolChoice(_Edge):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class CountTokensRequest(_Edge):
    """`POST /v1/messages/count_tokens`: what is rendered (no sampling fields)."""

    model: str
    messages: Annotated[list[AnthropicMessage], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: AnthropicToolChoice | None = None

    def check_supported(self) -> None:
        self.conversation()
        self.function_tools()
        choice = self.tool_choice
        if choice is not None and choice.type == "tool" and choice.name is None:
            raise invalid_request(
                "tool_choice.name: a tool choice of type 'tool' needs a name", "tool_choice.name"
            )

    def function_tools(self) -> list[AnthropicTool]:
        tools = []
        for index, raw in enumerate(self.tools or []):
            if raw.get("type", "custom") != "custom":
                raise invalid_request(
                    f"tools[{index}].type: tools of type {raw.get('type')!r} are not supported, "
                    "only client tools "
                    "with an input_schema",
                    f"tools[{index}].type",
                )
            tools.append(validated_part(AnthropicTool, raw, f"tools[{index}]"))
        return tools

    def conversation(self) -> list[dict[str, Any]]:
        """`system` and `messages` as chat messages (a 400 naming a bad block's field)."""
        messages: list[dict[str, Any]] = []
        if self.system is not None:
            system = self.system
            text = system if isinstance(system, str) else "".join(b.text for b in system)
            messages.append({"role": "system", "content": text})
        for index, message in enumerate(self.messages):
            messages.extend(_turn(message, f"messages[{index}]"))
        return messages

    def chat_fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {"model": self.model, "messages": self.conversation()}
        tools = self.function_tools()
        if tools:
            fields["tools"] = [
                {
                    "type": "function",
                    "function": {
                        "name": tool.name,
                        "parameters": tool.input_schema,
                        **({"description": tool.description} if tool.description else {}),
                    },
                }
                for tool in tools
            ]
        choice = self.tool_choice
        if choice is not None:
            fields["tool_choice"] = {
                "auto": "auto",
                "any": "required",
                "none": "none",
                "tool": {"type": "function", "function": {"name": choice.name}},
            }[choice.type]
            if choice.disable_parallel_tool_use is not None:
                fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
        return fields


class MessagesRequest(CountTokensRequest):
    """`POST /v1/messages` (see the module doc)."""

    max_tokens: Annotated[int, Field(ge=1)]
    stop_sequences: list[str] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None

    def chat_fields(self) -> dict[str, Any]:
        fields = super().chat_fields()
        fields["max_completion_tokens"] = self.max_tokens
        for name, value in (
            ("stop", self.stop_sequences),
            ("temperature", self.temperature),
            ("top_p", self.top_p),
            ("top_k", self.top_k),
        ):
            if value is not None:
                fields[name] = value
        return fields


def _turn(message: AnthropicMessage, where: str) -> list[dict[str, Any]]:
    """One Anthropic turn as chat messages: an assistant's text and calls as one message, a
    user's tool results as tool messages followed by its text (if any)."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for index, raw in enumerate(message.content):
        kind = raw.get("type")
        model = BLOCK_MODELS.get(kind) if isinstance(kind, str) else None
        allowed = (
            ("text", "tool_use", "thinking", "redacted_thinking")
            if message.role == "assistant"
            else ("text", "tool_result")
        )
        if model is None or kind not in allowed:
            raise invalid_request(
                f"{where}.content[{index}].type: blocks of type {kind!r} are not supported in "
                f"a {message.role} turn, "
                f"only {list(allowed)}",
                f"{where}.content[{index}].type",
            )
        block = validated_part(model, raw, f"{where}.content[{index}]")
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ThinkingBlock):
            continue  # earlier turns' thinking is not shown to the model again
        elif isinstance(block, ToolUseBlock):
            function = {"name": block.name, "arguments": json.dumps(block.input)}
            calls.append({"id": block.id, "type": "function", "function": function})
        else:
            results.append(
                {"role": "tool", "content": block.text(), "tool_call_id": block.tool_use_id}
            )
    if message.role == "assistant":
        turn: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
        if calls:
            turn["tool_calls"] = calls
        return [turn]
    return results + ([{"role": "user", "content": "".join(texts)}] if texts else [])


def parse_messages_request(body: bytes) -> MessagesRequest:
    request = parse_object(body, MessagesRequest)
    request.check_supported()
    return request


def parse_count_tokens_request(body: bytes) -> CountTokensRequest:
    request = parse_object(body, CountTokensRequest)
    request.check_supported()
    return request
