"""OpenAI tool calling on the chat endpoint: the request's tools, how they are rendered, enforced
and read back.

- **Rendering.** Messages keep their `tool_calls` (assistant) and `tool_call_id` (tool) and go
  through the model's chat template with `tools=`; a template that never mentions tools (as
  SmolLM2's) is replaced by `FALLBACK_TOOL_TEMPLATE`: ChatML with the tools listed in the system
  turn and calls written as Hermes' `<tool_call>{"name", "arguments"}</tool_call>` blocks,
  tool results as `<tool_response>` blocks in a user turn.
- **Parser.** The server reads calls with the `--tool-call-parser` it was given, else with the
  one that fits the model's template (`parser_for_template`): `hermes` for the fallback and for
  templates that write `<tool_call>`, `llama3_json` for Llama 3's.
- **`tool_choice`.** `none`: tools are shown, output is text. `auto` (OpenAI's default when
  tools are given): free text, read back by the parser. `required` with parallel calls: the
  output is a compact JSON array of one or more calls, `[{"name": "f", "arguments": {...}}]`,
  each of a listed function with arguments valid against its `parameters` (read back by
  `CallArrayParser`, whatever the parser): a small model ends the array after the call it meant
  more often than it stops between `<tool_call>` blocks. `required` with `parallel_tool_calls:
  false` and a named function: exactly one call in the parser's own call form (an xgrammar
  structural tag), e.g. `<tool_call>\n{"name": "f", "arguments": ` + arguments valid against
  `f`'s `parameters` + `}\n</tool_call>`.
- **Results.** Calls become `message.tool_calls` with finish_reason "tool_calls". A constrained
  choice always answers in `tool_calls`, also when `max_tokens` cuts it (the arguments as
  generated, finish_reason "length", as vLLM does). While streaming, each call's name goes
  first, then its arguments as they grow (`ToolStream`, read incrementally by the parser, the
  same reader for HTTP and gRPC and for whole answers).

Every refusal is a `FieldError` naming the field (`tools[1].function.parameters`,
`tool_choice`), turned into a 400 by the caller.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from cluster.engine.json_bounds import bounded_schema
from cluster.engine.structured_outputs import (
    ConstraintError,
    StructuredOutputsParams,
    check_constraint,
)
from cluster.serving.structured_fields import FieldError
from cluster.serving.tool_parsers import (
    TOOL_PARSERS,
    CallArrayParser,
    ParsedCall,
    ToolCallParser,
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
    """The server's tool flags: `--enable-auto-tool-choice` (on unless turned off) and
    `--tool-call-parser` (None: the one that fits the model's template, see `for_template`)."""

    enable_auto_tool_choice: bool = True
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(
                f"tool_call_parser must be one of {sorted(TOOL_PARSERS)}, got "
                f"{self.tool_call_parser!r}"
            )

    def for_template(self, model_template: str | None) -> ToolSettings:
        """These settings with the parser named: the flag's, else the template's."""
        parser = self.tool_call_parser or parser_for_template(model_template)
        return ToolSettings(self.enable_auto_tool_choice, parser)


def parser_for_template(model_template: str | None) -> str:
    """The parser that reads what the template teaches: `llama3_json` for Llama 3 templates
    (`<|python_tag|>`, header tokens), `hermes` for the fallback template, for templates that
    write `<tool_call>` blocks and for any other."""
    if template_for(model_template) is None and model_template is not None:
        if "<tool_call>" in model_template:
            return "hermes"
        if "<|python_tag|>" in model_template or "<|start_header_id|>" in model_template:
            return "llama3_json"
    return "hermes"


@dataclass(frozen=True)
class ToolPlan:
    """What one request does with its tools (None from `plan_tools`: nothing)."""

    tools: tuple[ToolDef, ...]
    mode: Literal["none", "auto", "required", "named"]
    name: str | None
    parallel: bool
    parser_name: str

    def template_tools(self) -> list[dict[str, Any]]:
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    @property
    def constrained(self) -> bool:
        """The output is made to be calls (`required` or a named function)."""
        return self.mode in ("required", "named")

    @property
    def array_form(self) -> bool:
        """The output is a JSON array of calls (`required` with parallel calls)."""
        return self.mode == "required" and self.parallel

    def constraint(self) -> StructuredOutputsParams | None:
        """The grammar that enforces `required` and named choices (None: unconstrained): a JSON
        array of calls (`array_form`), else one call in the parser's call form."""
        if not self.constrained:
            return None
        if self.array_form:
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
            array = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
            return StructuredOutputsParams(json=array, disable_any_whitespace=True)
        form = TOOL_PARSERS[self.parser_name].FORMAT
        tools = [self._tool(self.name)] if self.mode == "named" else list(self.tools)
        tags = [
            {
                "type": "tag",
                "begin": form.begin(tool.function.name),
                "content": {
                    "type": "json_schema",
                    "json_schema": bounded_schema(_parameters(tool)),
                    "max_whitespace_cnt": 1,
                },
                "end": form.end,
            }
            for tool in tools
        ]
        structure = {
            "type": "structural_tag",
            "format": {
                "type": "tags_with_separator",
                "tags": tags,
                "separator": form.separator,
                "at_least_one": True,
                "stop_after_first": self.mode == "named" or not self.parallel,
            },
        }
        return StructuredOutputsParams(structural_tag=json.dumps(structure, ensure_ascii=False))

    def parser(self) -> ToolCallParser | None:
        """A new reader of calls in one answer (None: the output is text): the array's reader
        for `array_form`, else the parser's."""
        if self.mode == "none":
            return None
        return CallArrayParser() if self.array_form else TOOL_PARSERS[self.parser_name]()

    def stream(self) -> ToolStream | None:
        """What reads calls out of a streamed output (None: the output is text)."""
        return None if self.mode == "none" else ToolStream(self)

    def _tool(self, name: str | None) -> ToolDef:
        return next(tool for tool in self.tools if tool.function.name == name)


def plan_tools(
    tools: list[ToolDef] | None,
    tool_choice: str | NamedToolChoice | None,
    parallel_tool_calls: bool | None,
    settings: ToolSettings,
) -> ToolPlan | None:
    """The request's tool plan (`settings` with their parser named, see
    `ToolSettings.for_template`); FieldError for a choice that names no listed tool, an unknown
    choice, `auto` on a server started without auto tool choice, or a `parameters` schema that
    cannot compile."""
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
            '"auto" tool choice is turned off on this server (--no-enable-auto-tool-choice); '
            'use "required", "none" or a named function',
        )
    parallel = True if parallel_tool_calls is None else parallel_tool_calls
    parser = settings.tool_call_parser or "hermes"
    return ToolPlan(tuple(tools), mode, name, parallel, parser)


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


def calls_of(text: str, plan: ToolPlan) -> tuple[str | None, list[ToolCallOut]]:
    """A finished output's content (None when it is only calls) and its calls: under `auto`
    the complete ones whose arguments are JSON; under a constrained choice every call begun,
    its arguments as generated (cut short by `max_tokens`, they are a prefix)."""
    parser = plan.parser()
    if parser is None:
        return text, []
    content = parser.feed(text).content + parser.finish().content
    cut = _call_cut_before_its_name(plan, parser)
    calls = [
        ToolCallOut(
            id=new_call_id(),
            type="function",
            function=FunctionCallOut(name=call.name, arguments=call.arguments),
        )
        for call in (parser.calls if cut is None else [cut])
        if plan.constrained or (call.complete and _is_json(call.arguments))
    ]
    if not calls:
        return text, []
    if plan.constrained:  # the grammar allows calls only: a cut tag is not content
        return None, calls
    return (content.strip() or None), calls


def _call_cut_before_its_name(plan: ToolPlan, parser: ToolCallParser) -> ParsedCall | None:
    """A named choice's call when `max_tokens` ended the answer before the parser read the
    name (the name is known: the call is still the answer, its arguments empty)."""
    if plan.mode == "named" and plan.name is not None and not parser.calls:
        return ParsedCall(plan.name, "", complete=False)
    return None


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
    """A streamed chat's tool-call deltas, per branch: feed each branch's new text (and whether
    it finished); get the content to send and the call deltas (a call's id, type and name
    first, then its arguments' new text). Each branch's parser reads every character once."""

    def __init__(self, plan: ToolPlan) -> None:
        self._plan = plan
        self._parsers: dict[int, ToolCallParser] = {}
        self._ids: dict[tuple[int, int], str] = {}

    def update(
        self, branch: int, text: str, finished: bool
    ) -> tuple[str | None, list[ToolCallOut] | None]:
        parser = self._parsers.get(branch)
        if parser is None:
            new = self._plan.parser()
            assert new is not None  # a plan that reads no calls has no stream
            parser = self._parsers[branch] = new
        delta = parser.feed(text)
        if finished:
            last = parser.finish()
            delta.content += last.content
            for call in last.calls:
                delta.add_call(call.index, call.name, call.arguments)
            cut = _call_cut_before_its_name(self._plan, parser)
            if cut is not None:
                delta.add_call(0, cut.name, cut.arguments)
        out = []
        for call in delta.calls:
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
        content = None if self._plan.constrained else delta.content or None
        return content, out or None

    def called(self, branch: int) -> bool:
        return any(key[0] == branch for key in self._ids)
