"""Structured outputs as a request states them: vLLM's `StructuredOutputsParams`, and the one
validation every front end runs on them.

A constraint is one of a JSON schema (`json`), a regular expression (`regex`), a list of
strings (`choice`), an EBNF grammar (`grammar`, xgrammar's dialect of GBNF), "any JSON
object" (`json_object`) or an xgrammar structural tag (`structural_tag`, JSON text: the form
tool calls are constrained to). `ConstraintSpec` is its exact, hashable form: the compile cache keys
on it (with the tokenizer's identity), so two requests share a compiled grammar only when their
constraints are the same text.

`check_constraint` parses the constraint into a tokenizer-free grammar (fast, no vocabulary
work) and bounds its size, so a front end refuses a constraint that cannot compile before it
reaches an engine; the engine compiles it against the vocabulary (see `grammar_backend`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from cluster.engine.json_bounds import bounded_schema

MAX_CONSTRAINT_CHARS = 64 * 1024
"""The largest constraint text (a schema as JSON, a regex, a grammar, all choices together)."""

MAX_GRAMMAR_CHARS = 1024 * 1024
"""The largest grammar a constraint may expand to (xgrammar's EBNF text): bounds what a small
schema or regex with large repetition counts costs to compile and to match."""

MAX_JSON_WHITESPACE = 16
"""Free whitespace between JSON tokens is at most this many characters per gap (enough for
indented JSON), so that a model cannot fill `max_tokens` with whitespace."""

KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


class ConstraintError(ValueError):
    """A constraint that cannot be compiled or is too large; `kind` names the field."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"structured_outputs.{kind}: {message}")
        self.kind = kind
        self.reason = message


@dataclass(frozen=True)
class ConstraintSpec:
    """The exact constraint: its kind and its text (a JSON schema as compact JSON, choices as a
    JSON list), plus whether JSON may have free whitespace."""

    kind: str
    text: str
    any_whitespace: bool = True


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's structured outputs: exactly one of `json` (a JSON schema, as a dict or JSON text),
    `regex`, `choice`, `grammar` (EBNF), `json_object=True` or `structural_tag` (JSON text).

    `disable_any_whitespace` makes JSON compact (no free whitespace between tokens); otherwise
    each gap may hold up to `MAX_JSON_WHITESPACE` whitespace characters."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    spec: ConstraintSpec = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        given = [kind for kind in KINDS if _is_set(getattr(self, kind))]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs needs exactly one of json, regex, choice, grammar, "
                f"json_object or structural_tag, got {given or 'none'}"
            )
        object.__setattr__(self, "spec", self._make_spec(given[0]))

    def _make_spec(self, kind: str) -> ConstraintSpec:
        whitespace = not self.disable_any_whitespace
        if kind == "json":
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as error:
                    raise ConstraintError("json", f"not valid JSON: {error}") from None
            if not isinstance(schema, dict | bool):
                raise ConstraintError("json", "a JSON schema must be an object")
            text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
            return ConstraintSpec("json", text, whitespace)
        if kind == "choice":
            choices = self.choice
            if (
                not isinstance(choices, list | tuple)
                or not choices
                or not all(isinstance(c, str) and c for c in choices)
            ):
                raise ConstraintError("choice", "must be a non-empty list of non-empty strings")
            return ConstraintSpec("choice", json.dumps(list(choices), ensure_ascii=False))
        if kind == "json_object":
            return ConstraintSpec("json_object", "", whitespace)
        text = getattr(self, kind)
        if not isinstance(text, str) or not text:
            raise ConstraintError(kind, "must be a non-empty string")
        return ConstraintSpec(kind, text)


def _is_set(value: object) -> bool:
    return value is not None and value is not False


def parse_grammar(spec: ConstraintSpec) -> Any:
    """The constraint as a tokenizer-free `xgrammar.Grammar`. Raises ConstraintError naming the
    field when it does not parse, uses what the backend does not support, or is too large."""
    import xgrammar as xgr

    if len(spec.text) > MAX_CONSTRAINT_CHARS:
        raise ConstraintError(
            spec.kind, f"{len(spec.text)} characters exceed the limit of {MAX_CONSTRAINT_CHARS}"
        )
    try:
        if spec.kind == "json":
            grammar = _json_grammar(spec.text, spec.any_whitespace, strict=True)
        elif spec.kind == "regex":
            grammar = xgr.Grammar.from_regex(spec.text)
        elif spec.kind == "choice":
            alternatives = " | ".join(json.dumps(c) for c in json.loads(spec.text))
            grammar = xgr.Grammar.from_ebnf(f"root ::= {alternatives}")
        elif spec.kind == "grammar":
            grammar = xgr.Grammar.from_ebnf(spec.text)
        elif spec.kind == "structural_tag":
            grammar = xgr.Grammar.from_structural_tag(spec.text)
        else:  # any JSON object
            grammar = _json_grammar('{"type":"object"}', spec.any_whitespace, strict=False)
    except (RuntimeError, ValueError, TypeError) as error:
        raise ConstraintError(spec.kind, _backend_message(error)) from None
    size = len(str(grammar))
    if size > MAX_GRAMMAR_CHARS:
        raise ConstraintError(
            spec.kind,
            f"expands to a grammar of {size} characters, above the limit of {MAX_GRAMMAR_CHARS}",
        )
    return grammar


def _json_grammar(schema: str, any_whitespace: bool, *, strict: bool) -> Any:
    """The schema's grammar, its open lengths bounded (`json_bounds.bounded_schema`)."""
    import xgrammar as xgr

    return xgr.Grammar.from_json_schema(
        json.dumps(bounded_schema(json.loads(schema))),
        any_whitespace=any_whitespace,
        strict_mode=strict,
        max_whitespace_cnt=MAX_JSON_WHITESPACE if any_whitespace else None,
    )


def check_constraint(params: StructuredOutputsParams | None) -> None:
    """Raises ConstraintError when `params` cannot be compiled (see `parse_grammar`)."""
    if params is not None:
        parse_grammar(params.spec)


def _backend_message(error: BaseException) -> str:
    """xgrammar's message without its C++ source location prefix."""
    text = str(error).strip()
    if text.startswith("[") and ": " in text:
        text = text.split(": ", 1)[1]
        if ".cc:" in text.split(" ", 1)[0]:
            text = text.split(": ", 1)[1] if ": " in text else text
    return text.splitlines()[0] if text else type(error).__name__
