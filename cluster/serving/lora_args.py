"""The LoRA part of the Serve application's `args` (pydantic at the edge).

`lora_modules` names the adapters every engine replica loads at start. Three spellings are
accepted and normalised to one list of `LoRAModuleArgs`:
- `{"name": "path", ...}` (the short form);
- vLLM's list form `[{"name": ..., "path": ..., "base_model_name": ...}, ...]`;
- `pagedserve serve --lora-modules` items: `name=path`, or a JSON object as vLLM accepts.

Invariants: adapter names are unique, never the served model's name, and contain no whitespace;
paths are non-empty. Giving any module (or `allow_runtime_lora_updating`) turns LoRA on in the
engine (`lora.enable_lora`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

ADAPTER_NAME = re.compile(r"^\S+$")


class LoRAModuleArgs(BaseModel):
    """One adapter served from start (vLLM's `LoRAModulePath`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=256, pattern=ADAPTER_NAME.pattern)
    path: str = Field(min_length=1)
    base_model_name: str | None = None


def normalise_lora_modules(value: Any) -> Any:
    """The accepted spellings (see the module doc) as a list of mappings; anything else is left
    for pydantic to refuse with its own message."""
    if isinstance(value, dict):
        return [{"name": name, "path": path} for name, path in value.items()]
    if isinstance(value, list):
        return [parse_module_item(item) if isinstance(item, str) else item for item in value]
    return value


def parse_module_item(item: str) -> dict[str, Any]:
    """One `--lora-modules` item: `name=path` or a JSON object with `name` and `path`. Raises
    ValueError naming the item when it is neither."""
    text = item.strip()
    if text.startswith("{"):
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"--lora-modules {item!r}: not valid JSON: {error}") from None
        if not isinstance(parsed, dict):
            raise ValueError(f"--lora-modules {item!r}: a JSON item must be an object")
        return parsed
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules {item!r}: expected name=path or a JSON object")
    return {"name": name, "path": path}


def check_unique(modules: Iterable[LoRAModuleArgs], served_model_name: str) -> None:
    """Raises ValueError for a repeated adapter name or one equal to the served model's."""
    seen: set[str] = set()
    for module in modules:
        if module.name == served_model_name:
            raise ValueError(
                f"lora_modules: adapter name {module.name!r} is the served model's name"
            )
        if module.name in seen:
            raise ValueError(f"lora_modules: adapter name {module.name!r} is given twice")
        seen.add(module.name)
