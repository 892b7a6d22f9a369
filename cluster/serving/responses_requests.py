"""`POST /v1/responses` requests as OpenAI defines them, validated at the edge and translated
into chat-completions fields (`chat_bridge` runs those).

- `input`: text (one user message) or items: messages (`role`, content as text or
  `input_text` / `output_text` parts), `function_call` items (an assistant's call),
  `function_call_output` items (the call's result, a tool message) and `reasoning` items (a
  previous answer's thinking, left out of the prompt); `instructions` is a
  system message before them (not carried over by `previous_response_id`, as in OpenAI's API).
- `tools`: function tools in the Responses' flat shape `{type, name, description, parameters,
  strict}`; `tool_choice`: `auto`, `none`, `required` or `{type: function, name}`.
- `text.format`: `text`, `json_object` or `json_schema` (`name`, `schema`, `strict`), through
  the structured-output path.
- `max_output_tokens`, `temperature`, `top_p`, `parallel_tool_calls`; `store` (default true)
  and `previous_response_id` are the route's (`responses_api`).

Invariants: types are strict and unknown fields ignored (as for chat); every refusal is a 400
naming the field as the Responses API spells it (`input[2].call_id`, `tools[0].parameters`,
`text.format.schema`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from cluster.serving.chat_bridge import ParamNames, validated_part
from cluster.serving.openai_protocol import invalid_request, parse_object

RESPONSES_NAMES = ParamNames(
    (
        (r"^messages", "input"),
        (r"^max_completion_tokens", "max_output_tokens"),
        (r"^tools\[(\d+)\]\.function\.", r"tools[\1]."),
        (r"^response_format\.json_schema\.schema", "text.format.schema"),
        (r"^response_format", "text.format"),
    )
)
"""Chat field names as the Responses API spells them, for errors."""


class _Edge(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(_Edge):
    """A text part of a message's content (`input_text` in input, `output_text` in output)."""

    type: Literal["input_text", "output_text", "text"]
    text: str


class MessageItem(_Edge):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionCallItem(_Edge):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Edge):
    type: Literal["function_call_output"]
    call_id: str
    output: str


class ReasoningItem(_Edge):
    """A previous answer's thinking span, as a client sends its output back: accepted and left
    out of the prompt (a reasoning model's template drops earlier turns' thinking)."""

    type: Literal["reasoning"]
    summary: list[dict[str, Any]] = []
    content: list[dict[str, Any]] | None = None


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
ITEM_MODELS: dict[str, type[InputItem]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
}


class FunctionTool(_Edge):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(_Edge):
    type: Literal["function"]
    name: str


class TextFormat(_Edge):
    type: Literal["text", "json_object", "json_schema"]
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextOptions(_Edge):
    format: TextFormat | None = None


class ResponsesRequest(_Edge):
    """`POST /v1/responses` (see the module doc). `input` items are checked one by one
    (`items`), so an error names the item's field."""

    model: str
    input: str | Annotated[list[dict[str, Any]], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    background: bool = False

    def check_supported(self) -> None:
        if self.background:
            raise invalid_request(
                "background: background responses are not supported", "background"
            )
        self.items()
        self.function_tools()

    def items(self) -> list[InputItem]:
        """`input` as items (text is one user message); a 400 naming the bad item's field."""
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        items = []
        for index, raw in enumerate(self.input):
            kind = raw.get("type", "message")
            model = ITEM_MODELS.get(kind) if isinstance(kind, str) else None
            if model is None:
                raise invalid_request(
                    f"input[{index}].type: items of type {kind!r} are not supported, only "
                    f"{sorted(ITEM_MODELS)}",
                    f"input[{index}].type",
                )
            items.append(validated_part(model, raw, f"input[{index}]"))
        return items

    def function_tools(self) -> list[FunctionTool]:
        tools = []
        for index, raw in enumerate(self.tools or []):
            if raw.get("type") != "function":
                raise invalid_request(
                    f"tools[{index}].type: tools of type {raw.get('type')!r} are not supported, "
                    "only 'function'",
                    f"tools[{index}].type",
                )
            tools.append(validated_part(FunctionTool, raw, f"tools[{index}]"))
        return tools

    def conversation(self, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The chat messages of `history` (the stored conversation `previous_response_id`
        continues) then of `input`; without `instructions`."""
        return list(history) + conversation_of(self.items())

    def chat_fields(self, conversation: list[dict[str, Any]]) -> dict[str, Any]:
        """The chat-completions fields this request runs as: `instructions` as the system
        message, then `conversation`."""
        messages = list(conversation)
        if self.instructions is not None:
            messages.insert(0, {"role": "system", "content": self.instructions})
        fields: dict[str, Any] = {"model": self.model, "messages": messages}
        for name, value in (
            ("max_completion_tokens", self.max_output_tokens),
            ("temperature", self.temperature),
            ("top_p", self.top_p),
            ("parallel_tool_calls", self.parallel_tool_calls),
        ):
            if value is not None:
                fields[name] = value
        tools = self.function_tools()
        if tools:
            fields["tools"] = [
                {
                    "type": "function",
                    "function": tool.model_dump(exclude={"type"}, exclude_none=True),
                }
                for tool in tools
            ]
        if isinstance(self.tool_choice, NamedFunction):
            fields["tool_choice"] = {
                "type": "function",
                "function": {"name": self.tool_choice.name},
            }
        elif self.tool_choice is not None:
            fields["tool_choice"] = self.tool_choice
        text_format = self.text.format if self.text is not None else None
        if text_format is not None and text_format.type != "text":
            fields["response_format"] = response_format_of(text_format)
        return fields


def response_format_of(text_format: TextFormat) -> dict[str, Any]:
    """`text.format` as chat's `response_format`."""
    if text_format.type == "json_object":
        return {"type": "json_object"}
    spec: dict[str, Any] = {"name": text_format.name}
    if text_format.schema_ is not None:
        spec["schema"] = text_format.schema_
    if text_format.strict is not None:
        spec["strict"] = text_format.strict
    return {"type": "json_schema", "json_schema": spec}


def conversation_of(items: list[InputItem]) -> list[dict[str, Any]]:
    """Items as chat messages: consecutive `function_call` items are one assistant message's
    calls (after its text when the assistant message just before has no calls yet)."""
    messages: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": item.text()})
        elif isinstance(item, ReasoningItem):
            continue  # earlier turns' thinking is not shown to the model again
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "content": item.output, "tool_call_id": item.call_id})
    return messages


def parse_responses_request(body: bytes) -> ResponsesRequest:
    """The body as a Responses request; every failure is a 400 naming the field."""
    request = parse_object(body, ResponsesRequest)
    request.check_supported()
    return request
