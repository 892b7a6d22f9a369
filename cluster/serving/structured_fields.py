"""The structured-outputs fields of a request at the edge, and the one translation of them into
the engine's `StructuredOutputsParams` that HTTP and gRPC share.

OpenAI's `response_format` (`text`, `json_object`, `json_schema` with `strict`) and vLLM's
`structured_outputs` extra field (`json`, `regex`, `choice`, `grammar`, `json_object`) both
become one `StructuredOutputsParams`; asking for both is refused. `strict` does not change what
is enforced: the schema always is, as in vLLM.

Every failure is `FieldError(param, message)` naming the request field (for example
`response_format.json_schema.schema`); the front end turns it into its own error (HTTP 400 in
OpenAI's body, gRPC INVALID_ARGUMENT). The check parses the constraint without the tokenizer
(`check_constraint`), so a constraint that cannot compile never reaches an engine.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from cluster.engine.structured_outputs import (
    ConstraintError,
    StructuredOutputsParams,
    check_constraint,
)


class FieldError(ValueError):
    """A request field (`param`, dotted) holds a value the server refuses."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


class _Edge(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class JSONSchemaFormat(_Edge):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Edge):
    """OpenAI's `response_format`."""

    type: str
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsField(_Edge):
    """vLLM's `structured_outputs` extra field."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


def structured_outputs_of(
    response_format: ResponseFormat | None, structured: StructuredOutputsField | None
) -> StructuredOutputsParams | None:
    """The engine's constraint for a request's fields (None: unconstrained). Raises FieldError
    naming the field for a constraint that is unknown, conflicting or does not compile."""
    from_format = _from_response_format(response_format)
    from_field = _from_structured_field(structured)
    if from_format is not None and from_field is not None:
        raise FieldError(
            "structured_outputs", "give either response_format or structured_outputs, not both"
        )
    params, prefix = from_format or from_field or (None, "")
    if params is None:
        return None
    try:
        check_constraint(params)
    except ConstraintError as error:
        param = prefix if prefix.startswith("response_format") else f"{prefix}.{error.kind}"
        raise FieldError(param, f"{param}: {error.reason}") from None
    return params


def _from_response_format(
    response_format: ResponseFormat | None,
) -> tuple[StructuredOutputsParams, str] | None:
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return _build("response_format", json_object=True), "response_format"
    if response_format.type != "json_schema":
        raise FieldError(
            "response_format.type",
            f"response_format.type must be 'text', 'json_object' or 'json_schema', got "
            f"{response_format.type!r}",
        )
    spec = response_format.json_schema
    if spec is None or spec.schema_ is None:
        raise FieldError(
            "response_format.json_schema.schema",
            "response_format of type 'json_schema' needs json_schema.schema",
        )
    param = "response_format.json_schema.schema"
    return _build(param, json=spec.schema_), param


def _from_structured_field(
    structured: StructuredOutputsField | None,
) -> tuple[StructuredOutputsParams, str] | None:
    if structured is None:
        return None
    params = _build(
        "structured_outputs",
        json=structured.json_,
        regex=structured.regex,
        choice=structured.choice,
        grammar=structured.grammar,
        json_object=structured.json_object,
        disable_any_whitespace=structured.disable_any_whitespace,
    )
    return params, "structured_outputs"


def _build(param: str, **fields: Any) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**fields)
    except ConstraintError as error:
        where = param if param.startswith("response_format") else f"{param}.{error.kind}"
        raise FieldError(where, f"{where}: {error.reason}") from None
    except ValueError as error:
        raise FieldError(param, str(error)) from None
