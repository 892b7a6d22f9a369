"""Bounds on what a JSON schema leaves open, so that a constrained answer can always end.

A grammar guarantees an answer's shape, not that it ends: a small model inside an open string
or number can write `1.1.1.1...` until `max_tokens`. `bounded_schema` gives every string
without a length, pattern, format or set of values at most `MAX_OPEN_STRING` characters, and
every integer without bounds at most `MAX_INTEGER_DIGITS` digits, so the grammar closes such a
value and the model goes on to the next field. Every output valid under the bounded schema is
valid under the original; the user's schema is what requests are keyed and validated by.
"""

from __future__ import annotations

from typing import Any

MAX_OPEN_STRING = 256
"""Characters a string value may hold when its schema does not say."""

MAX_INTEGER_DIGITS = 18
"""Digits an integer value may hold when its schema gives no bounds (int64's range, about)."""

_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SUBSCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains")
_STRING_LIMITS = ("maxLength", "pattern", "format", "enum", "const")
_NUMBER_LIMITS = ("maximum", "exclusiveMaximum", "enum", "const")


def bounded_schema(schema: Any) -> Any:
    """A copy of `schema` with open string lengths and integer sizes bounded (see the module
    docstring); anything that is not a schema object is returned as it is."""
    if not isinstance(schema, dict):
        return schema
    bounded = dict(schema)
    for key in _SUBSCHEMA_LISTS:
        if isinstance(bounded.get(key), list):
            bounded[key] = [bounded_schema(item) for item in bounded[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(bounded.get(key), dict):
            bounded[key] = {name: bounded_schema(sub) for name, sub in bounded[key].items()}
    for key in _SUBSCHEMAS:
        if key in bounded:
            bounded[key] = bounded_schema(bounded[key])
    types = bounded.get("type")
    types = types if isinstance(types, list) else [types]
    if "string" in types and not any(key in bounded for key in _STRING_LIMITS):
        bounded["maxLength"] = MAX_OPEN_STRING
    if types == ["integer"] and not any(key in bounded for key in _NUMBER_LIMITS):
        bounded["maximum"] = 10**MAX_INTEGER_DIGITS - 1
    if types == ["integer"] and not any(
        key in bounded for key in ("minimum", "exclusiveMinimum", "enum", "const")
    ):
        bounded["minimum"] = -(10**MAX_INTEGER_DIGITS - 1)
    return bounded
