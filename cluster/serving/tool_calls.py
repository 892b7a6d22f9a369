"""OpenAI tool calling on the chat endpoint: the request's tools, how they are rendered, enforced
and read back.

- **Rendering.** Messages keep their `tool_calls` (assistant) and `tool_call_id` (tool) and go
  through the model's chat template with `tools=`; a template that never mentions tools (as
  SmolLM2's) is replaced by `FALLBACK_TOOL_TEMPLATE`: ChatML with the tools listed in the system
  turn and calls written as Hermes' `<tool_call>{"name", "arguments"}</tool_call>` blocks,
  tool results as `<tool_response>` blocks in a user turn.
- **`tool_choice`.** `none`: tools are shown, output is text. `required`: the output is
  constrained to a JSON array of calls of listed functions, each with arguments that satisfy
  the function's `parameters` schema (one call unless `parallel_tool_calls`). A named function:
  the output is constrained to that function's arguments. Both are compact JSON. `auto`
  (OpenAI's default when tools are given): free text, read back by the `--tool-call-parser`
  (needs `--enable-auto-tool-choice`, as in vLLM).
- **Results.** Parsed calls become `message.tool_calls` with finish_reason "tool_calls"; while
  streaming, each call's name goes first, then its arguments as they grow.

Every refusal is a `FieldError` naming the field (`tools[1].function.parameters`,
`tool_choice`), turned into a 400 by the caller.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from cluster.engine.structured_outputs import (
    ConstraintError,
    StructuredOutputsParams,
    check_constraint,
)
from cluster.serving.structured_fields import FieldError
from cluster.serving.tool_parsers import (
    TOOL_PARSERS,
    JsonArrayParser,
    ParsedText,
    PartialCall,
    ToolCallDeltas,
    ToolParser,
)

FALLBACK_TOOL_TEMPLATE = """\
{%- set system = messages[0]['content'] if messages and messages[0]['role'] == 'system' else '' -%}
{{- '<|im_start|>system\\n' + system -}}
{%- if tools -%}
{%- if system %}{{ '\\n\\n' }}{% endif -%}
{{- 'You may call one or more functions. The functions are listed in <tools></tools>:\\n<tools>' -}}
{%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor -%}
{{- '\\n</tools>\\nTo call a function, reply with one <tool_call></tool_call> block per call, '
    'each holding a JSON object with the function name and its arguments:\\n<tool_call>\\n'
    '{\\"name\\": <function-name>, \\"arguments\\": <arguments-object>}\\n</tool_call>' -}}
{%- endif -%}
{{- '<|im_end|>\\n' -}}
{%- for message in messages -%}
{%- if message['role'] == 'system' and loop.first -%}
{%- elif message['role'] == 'tool' -%}
{{- '<|im_start|>user\\n<tool_response>\\n' + message['content']
    + '\\n</tool_response><|im_end|>\\n' -}}
{%- elif message['role'] == 'assistant' and message.get('tool_calls') -%}
{{- '<|im_start|>assistant\\n' -}}
{%- if message['content'] %}{{ message['content'] + '\\n' }}{% endif -%}
{%- for call in message['tool_calls'] -%}
{{- '<tool_call>\\n{\\"name\\": ' + (call['function']['name'] | tojson) + ', \\"arguments\\": '
    + (call['function']['arguments'] | tojson) + '}\\n</tool_call>\\n' -}}
{%- endfor -%}
{{- '<|im_end|>\\n' -}}
{%- else -%}
{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif -%}
"""
"""ChatML with Hermes-style tool calls, for models whose own template has no tool support."""


class _Edge(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class FunctionDef(_Edge):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Edge):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Edge):
    name: str


class NamedToolChoice(_Edge):
    type: Literal["function"]
    function: FunctionName


class FunctionCallIn(_Edge):
    name: str
    arguments: str


class ToolCallIn(_Edge):
    """A call in an assistant message of the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class FunctionCallOut(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallOut(BaseModel):
    """A call in a response (`index` only while streaming)."""

    index: int | None = None
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallOut


@dataclass(frozen=True)
class ToolSettings:
    """The server's tool flags: `--enable-auto-tool-choice` and `--tool-call-parser`."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(
                f"tool_call_parser must be one of {sorted(TOOL_PARSERS)}, got "
                f"{self.tool_call_parser!r}"
            )
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs a tool_call_parser")


class NamedCallParser:
    """The named choice's output is the arguments object of that one function."""

    def __init__(self, name: str) -> None:
        self.name = name

    def parse(self, text: str) -> ParsedText:
        return ParsedText("", [PartialCall(self.name, text, complete=False)])


@dataclass(frozen=True)
class ToolPlan:
    """What one request does with its tools (None from `plan_tools`: nothing)."""

    tools: tuple[ToolDef, ...]
    mode: Literal["none", "auto", "required", "named"]
    name: str | None
    parallel: bool
    parser_name: str | None

    def template_tools(self) -> list[dict[str, Any]]:
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    def constraint(self) -> StructuredOutputsParams | None:
        """The grammar that enforces `required` and named choices (None: unconstrained)."""
        if self.mode == "named":
            return StructuredOutputsParams(
                json=_parameters(self._tool(self.name)), disable_any_whitespace=True
            )
        if self.mode != "required":
            return None
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": tool.function.name},
                    "arguments": _parameters(tool),
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for tool in self.tools
        ]
        schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema, disable_any_whitespace=True)

    def parser(self) -> ToolParser | None:
        """What reads calls out of the output (None: the output is text)."""
        if self.mode == "named":
            assert self.name is not None
            return NamedCallParser(self.name)
        if self.mode == "required":
            return JsonArrayParser()
        if self.mode == "auto" and self.parser_name is not None:
            return TOOL_PARSERS[self.parser_name]()
        return None

    def stream(self) -> ToolStream | None:
        """What reads calls out of a streamed output (None: the output is text)."""
        parser = self.parser()
        return None if parser is None else ToolStream(parser)

    def _tool(self, name: str | None) -> ToolDef:
        return next(tool for tool in self.tools if tool.function.name == name)


def plan_tools(
    tools: list[ToolDef] | None,
    tool_choice: str | NamedToolChoice | None,
    parallel_tool_calls: bool | None,
    settings: ToolSettings,
) -> ToolPlan | None:
    """The request's tool plan; FieldError for a choice that names no listed tool, an unknown
    choice, `auto` without the server's flags, or a `parameters` schema that cannot compile."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise FieldError("tool_choice", "tool_choice needs tools")
        return None
    for index, tool in enumerate(tools):
        params = StructuredOutputsParams(json=_parameters(tool))
        try:
            check_constraint(params)
        except ConstraintError as error:
            param = f"tools[{index}].function.parameters"
            raise FieldError(param, f"{param}: {error.reason}") from None
    names = [tool.function.name for tool in tools]
    if len(set(names)) != len(names):
        raise FieldError("tools", "function names in tools must be unique")
    choice = "auto" if tool_choice is None else tool_choice
    name = None
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in names:
            raise FieldError(
                "tool_choice", f"tool_choice names function {name!r}, which is not in tools"
            )
        mode: Literal["none", "auto", "required", "named"] = "named"
    elif choice in ("none", "auto", "required"):
        mode = choice  # type: ignore[assignment]
    else:
        raise FieldError(
            "tool_choice",
            f"tool_choice must be 'none', 'auto', 'required' or a named function, got {choice!r}",
        )
    if mode == "auto" and not settings.enable_auto_tool_choice:
        raise FieldError(
            "tool_choice",
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to '
            "be set",
        )
    parallel = True if parallel_tool_calls is None else parallel_tool_calls
    return ToolPlan(tuple(tools), mode, name, parallel, settings.tool_call_parser)


def template_for(model_template: str | None) -> str | None:
    """The model's template when it supports tools, else the fallback (None: the model's)."""
    if model_template and "tools" in model_template:
        return None
    return FALLBACK_TOOL_TEMPLATE


def render_options(
    plan: ToolPlan | None, messages: list[Any], model_template: str | None
) -> dict[str, Any]:
    """How a chat renders (`chat_template`, `tools` for the renderer): with its tools, through a
    template that supports them (see `template_for`), when it has tools or tool messages."""
    uses_tools = plan is not None or any(m.tool_calls or m.role == "tool" for m in messages)
    if not uses_tools:
        return {}
    return {
        "chat_template": template_for(model_template),
        "tools": plan.template_tools() if plan is not None else None,
    }


def template_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """Chat messages as templates take them: `developer` is `system`; an assistant's calls keep
    their arguments as an object (JSON text that does not parse stays text); a tool message
    keeps its `tool_call_id`."""
    rendered = []
    for message in messages:
        entry: dict[str, Any] = {
            "role": "system" if message.role == "developer" else message.role,
            "content": message.text(),
        }
        if message.tool_calls:
            entry["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": _loads_or_text(call.function.arguments),
                    },
                }
                for call in message.tool_calls
            ]
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        rendered.append(entry)
    return rendered


def calls_of(text: str, parser: ToolParser) -> tuple[str | None, list[ToolCallOut]]:
    """A finished output's content (None when it is only calls) and its complete calls."""
    parsed = parser.parse(text)
    calls = [
        ToolCallOut(
            id=new_call_id(),
            type="function",
            function=FunctionCallOut(name=call.name, arguments=call.arguments),
        )
        for call in parsed.calls
        if call.name is not None and _is_json(call.arguments)
    ]
    if not calls:
        return text, []
    return (parsed.content or None), calls


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _parameters(tool: ToolDef) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def _loads_or_text(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


class ToolStream:
    """A streamed chat's tool-call deltas, per branch (parsers are stateless, one serves every
    branch): feed each branch's whole text so far;
    get the content to send and the call deltas (a call's id, type and name first, then its
    arguments' new text)."""

    def __init__(self, parser: ToolParser) -> None:
        self._parser = parser
        self._branches: dict[int, ToolCallDeltas] = {}
        self._ids: dict[tuple[int, int], str] = {}

    def update(
        self, branch: int, text: str, finished: bool
    ) -> tuple[str | None, list[ToolCallOut] | None]:
        deltas = self._branches.setdefault(branch, ToolCallDeltas(self._parser))
        content, calls = deltas.update(text, finished)
        out = []
        for call in calls:
            first = call.name is not None
            if first:
                self._ids[(branch, call.index)] = new_call_id()
            out.append(
                ToolCallOut(
                    index=call.index,
                    id=self._ids[(branch, call.index)] if first else None,
                    type="function" if first else None,
                    function=FunctionCallOut(name=call.name, arguments=call.arguments),
                )
            )
        return content or None, out or None

    def called(self, branch: int) -> bool:
        deltas = self._branches.get(branch)
        return deltas is not None and bool(deltas.named)
