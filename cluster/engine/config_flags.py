"""Command-line flags for pydantic settings sections: one `--field-name` flag per field, read
back as the raw values that were given (for pydantic to coerce and validate). The one flag
generator of every command that takes engine or LoRA settings.
"""

from __future__ import annotations

import argparse
from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel


def _parse_flag_value(value: Any) -> Any:
    """Flag strings are handed to pydantic, which coerces them; 'none' means None."""
    if isinstance(value, str) and value.lower() in ("none", "null"):
        return None
    return value


def add_section_flags(
    group: argparse._ArgumentGroup,
    section_name: str,
    section_type: type[BaseModel],
    default_source: str | None = None,
) -> None:
    """One `--field-name` flag per field of a section, stored as `section.field` (None when not
    given; a string for pydantic to coerce, 'none' meaning None: `section_values`); booleans,
    and booleans that may also be a word (`bool | Literal["auto"]`, the word set in a config
    file), take `--no-field-name` too (vLLM's `--enable-X` / `--no-enable-X`). The help shows
    the field's default, after `default_source` (e.g. "the config file") when the flag's default
    comes from there."""
    for name, info in section_type.model_fields.items():
        flag = "--" + name.replace("_", "-")
        default = (
            f"{info.default!r}"
            if default_source is None
            else (f"{default_source}, else {info.default!r}")
        )
        help_text = f"{info.description or ''} (default: {default})".strip()
        if _bool_or_literal(info.annotation):
            group.add_argument(
                flag,
                dest=f"{section_name}.{name}",
                action=argparse.BooleanOptionalAction,
                default=None,
                help=help_text,
            )
        else:
            group.add_argument(
                flag,
                dest=f"{section_name}.{name}",
                default=None,
                metavar=_metavar(name, info.annotation),
                help=help_text,
            )


def _bool_or_literal(annotation: Any) -> bool:
    """A bool field, or one that is a bool or a literal word (`bool | Literal["auto"]`)."""
    if annotation is bool:
        return True
    members = get_args(annotation)
    return bool in members and all(arg is bool or get_origin(arg) is Literal for arg in members)


def _metavar(name: str, annotation: Any) -> str:
    """`{a,b,c}` for a field of literal choices (as argparse shows `choices`), `NAME|a` for a
    value or a literal (`int | Literal["auto"]`), else NAME."""
    if get_origin(annotation) is Literal:
        return "{" + ",".join(str(value) for value in get_args(annotation)) + "}"
    members = [arg for arg in get_args(annotation) if arg is not type(None)]
    literals = [str(v) for arg in members if get_origin(arg) is Literal for v in get_args(arg)]
    if not literals:
        return name.upper()
    if all(get_origin(arg) is Literal for arg in members):
        return "{" + ",".join(literals) + "}"
    return "|".join([name.upper(), *literals])


def section_values(args: argparse.Namespace, section: str) -> dict[str, Any]:
    """The flags of `section` that were given (see `add_section_flags`), as raw values."""
    prefix = f"{section}."
    return {
        key.removeprefix(prefix): _parse_flag_value(value)
        for key, value in vars(args).items()
        if key.startswith(prefix) and value is not None
    }
