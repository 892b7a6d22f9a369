"""The sampling a request gets for the fields it leaves unset: the model's recommended
generation defaults, as vLLM's `--generation-config` and `--override-generation-config` pick
them.

`model.generation_config` says where they come from:
- `auto` (the default): the model's own recommendation: an HF directory's
  `generation_config.json`; a GGUF file's `general.sampling.*` metadata (llama.cpp's keys), with
  a `generation_config.json` beside the file winning key by key; for the shipped `"default"`
  model, its model card's (`workers.model_source.DEFAULT_MODEL_SAMPLING`);
- `vllm`: none, the engine's own defaults (`SamplingParams`': temperature 1.0, OpenAI's nominal
  default, no top-p/top-k/min-p filter, no repetition penalty);
- a folder: that folder's `generation_config.json`.
`model.override_generation_config` (HF key names) is merged over what that gives.

Invariants:
- only temperature, top_p, top_k, min_p, repetition_penalty and max_new_tokens (the default
  `max_tokens`) are read, as vLLM reads them; `do_sample: false` means greedy (temperature 0), as
  HF's `generate` treats it;
- a default applies only to a field a request leaves unset (absent or null): an explicit value,
  1.0 and 0 included, always wins (`GenerationDefaults.fill`);
- every value is checked as `SamplingParams` checks it when the config is loaded; a bad one is a
  ValueError naming where it came from and the key.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from gguf import Keys

from cluster.engine.sampling_params import SamplingParams
from workers.gguf_header import read_gguf_header
from workers.model_source import DEFAULT_MODEL_SAMPLING, is_gguf, resolve_model_path

log = logging.getLogger(__name__)

GENERATION_CONFIG_FILE = "generation_config.json"
AUTO, ENGINE_ONLY = "auto", "vllm"
"""`model.generation_config`'s words: the model's recommendation, or the engine's defaults."""

HF_KEYS: Mapping[str, str] = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
"""Generation-config key (HF's name, also `--override-generation-config`'s) -> our field."""

GGUF_KEYS: Mapping[str, str] = {
    Keys.General.SAMPLING_TEMP: "temperature",
    Keys.General.SAMPLING_TOP_P: "top_p",
    Keys.General.SAMPLING_TOP_K: "top_k",
    Keys.General.SAMPLING_MIN_P: "min_p",
    Keys.General.SAMPLING_PENALTY_REPEAT: "repetition_penalty",
}
"""llama.cpp's GGUF sampling metadata key -> the generation-config key (`HF_KEYS`)."""

_INTEGER_FIELDS = frozenset({"top_k", "max_tokens"})
SAMPLING_FIELDS = frozenset(HF_KEYS.values()) - {"max_tokens"}
"""The fields `GenerationDefaults.fill` fills (the token limit has `max_tokens_or`)."""


@dataclass(frozen=True)
class GenerationDefaults:
    """What a request that leaves a sampling field unset gets, and where it came from. A field
    None is the engine's own default (`SamplingParams`'); `max_tokens` None keeps each API's
    own default (16 for completions and gRPC, the context for chat)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None
    source: str = "the engine's own defaults"

    def given(self) -> dict[str, float | int]:
        """The fields the model (or the override) sets, by our names."""
        return {
            f.name: value
            for f in dataclasses.fields(self)
            if f.name != "source" and (value := getattr(self, f.name)) is not None
        }

    def fill(self, **requested: Any) -> dict[str, Any]:
        """The sampling fields of a request (temperature, top_p, top_k, min_p,
        repetition_penalty; each None when the request leaves it unset): its own value, else
        this default, else `SamplingParams`' own."""
        filled = {}
        for name, value in requested.items():
            if name not in SAMPLING_FIELDS:
                raise ValueError(f"{name!r} is not a generation-config sampling field")
            given = getattr(self, name) if value is None else value
            filled[name] = (
                given if given is not None else SamplingParams.__dataclass_fields__[name].default
            )
        return filled

    def max_tokens_or(self, requested: int | None, api_default: int | None) -> int | None:
        """The token limit of a request: its own, else the model's, else the API's default."""
        if requested is not None:
            return requested
        return self.max_tokens if self.max_tokens is not None else api_default

    def sampling_params(self) -> SamplingParams:
        """The parameters of a request that sets nothing (vLLM's
        `LLM.get_default_sampling_params`): these defaults over `SamplingParams()`."""
        return SamplingParams(**self.given())

    def describe(self) -> str:
        """One line for the start-up log: what applies and from where."""
        given = self.given()
        if not given:
            engine = SamplingParams()
            return (
                f"Default sampling parameters: {self.source} (temperature {engine.temperature}, "
                f"top_p {engine.top_p}, no top_k, min_p or repetition penalty); a request's own "
                "values win"
            )
        values = ", ".join(f"{name}={value}" for name, value in given.items())
        return (
            f"Default sampling parameters have been overridden by {self.source}: {values}. A "
            "request's own values win; relaunch with --generation-config vllm for the engine's "
            "own defaults"
        )


ENGINE_DEFAULTS = GenerationDefaults()
"""No model defaults: every unset field gets `SamplingParams`' own (`--generation-config vllm`)."""


class GenerationSettings(Protocol):
    """The model settings the defaults come from (`cluster.engine.config.ModelSettings`)."""

    @property
    def model(self) -> str: ...

    @property
    def generation_config(self) -> str: ...

    @property
    def override_generation_config(self) -> Mapping[str, Any]: ...


def checked_values(values: Mapping[str, Any], where: str = "") -> dict[str, Any]:
    """HF-named generation-config `values` as our fields, each checked as `SamplingParams`
    checks it; a ValueError names `where` (if given) and the key (unknown keys included)."""
    prefix = f"{where}: " if where else ""
    unknown = sorted(set(values) - set(HF_KEYS))
    if unknown:
        raise ValueError(f"{prefix}unknown keys {unknown}; known: {sorted(HF_KEYS)}")
    fields: dict[str, Any] = {}
    for key, value in values.items():
        name = HF_KEYS[key]
        wanted = (int,) if name in _INTEGER_FIELDS else (int, float)
        if isinstance(value, bool) or not isinstance(value, wanted):
            kind = "an integer" if name in _INTEGER_FIELDS else "a number"
            raise ValueError(f"{prefix}{key} must be {kind}, got {value!r}")
        fields[name] = value
        try:
            SamplingParams(**{name: value})
        except ValueError as error:
            named = "" if name == key else f"{key}: "  # SamplingParams names our field
            raise ValueError(f"{prefix}{named}{error}") from None
    return fields


def parse_override(value: Any) -> dict[str, Any]:
    """`model.override_generation_config` as given: a mapping, or JSON text of one (the
    `--override-generation-config` flag's); keys and values checked (`checked_values`), kept in
    HF's names. A ValueError says what is wrong."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"not JSON: {error}") from None
    if not isinstance(value, Mapping):
        raise ValueError(f"must be a JSON object of generation-config keys, got {value!r}")
    checked_values(value)
    return dict(value)


def read_generation_config(path: pathlib.Path) -> dict[str, Any]:
    """Our fields from a `generation_config.json`: the keys we read (others are HF's business),
    `do_sample: false` as temperature 0. A ValueError names the file and the key."""
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} cannot be read as JSON: {error}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: the top level must be a JSON object")
    fields = checked_values(
        {key: value for key, value in config.items() if key in HF_KEYS and value is not None},
        str(path),
    )
    if config.get("do_sample") is False:
        fields["temperature"] = 0.0
    return fields


def read_gguf_sampling(path: pathlib.Path) -> dict[str, Any]:
    """Our fields from a GGUF file's `general.sampling.*` metadata (float32 values rounded to
    the 7 digits they hold)."""
    header = read_gguf_header(path)
    values: dict[str, Any] = {}
    for key, hf_key in GGUF_KEYS.items():
        field = header.fields.get(key)
        if field is None:
            continue
        value = field.contents()
        integer = HF_KEYS[hf_key] in _INTEGER_FIELDS
        values[hf_key] = int(value) if integer else float(f"{float(value):.7g}")
    return checked_values(values, str(path))


def model_recommendation(model: str) -> tuple[dict[str, Any], str]:
    """The model's own recommended fields and where they were read (`--generation-config
    auto`); empty when the model recommends nothing."""
    if model == "default":
        return (
            checked_values(DEFAULT_MODEL_SAMPLING, "the default model's card"),
            "SmolLM2-135M-Instruct's model card (the default model)",
        )
    path = resolve_model_path(model)
    if not is_gguf(path):
        config = path / GENERATION_CONFIG_FILE
        if config.is_file():
            return read_generation_config(config), f"the model's {config}"
        return {}, f"the engine's own defaults ({path} has no {GENERATION_CONFIG_FILE})"
    fields = read_gguf_sampling(path)
    sources = ["the GGUF file's general.sampling metadata"] if fields else []
    beside = path.parent / GENERATION_CONFIG_FILE
    if beside.is_file():
        fields |= read_generation_config(beside)
        sources.append(f"{beside}")
    if not fields:
        return {}, "the engine's own defaults (the model recommends no sampling)"
    return fields, " and ".join(sources)


def generation_defaults(settings: GenerationSettings) -> GenerationDefaults:
    """The defaults `settings` select (see the module doc); a ValueError names a missing
    folder or file, a bad value and its key."""
    choice = settings.generation_config
    if choice == ENGINE_ONLY:
        fields: dict[str, Any] = {}
        source = "the engine's own defaults (--generation-config vllm)"
    elif choice == AUTO:
        fields, source = model_recommendation(settings.model)
    else:
        config = pathlib.Path(choice).expanduser() / GENERATION_CONFIG_FILE
        if not config.is_file():
            raise ValueError(
                f"model.generation_config {choice!r}: no {GENERATION_CONFIG_FILE} there (give "
                f"'{AUTO}', '{ENGINE_ONLY}' or a folder holding one)"
            )
        fields, source = read_generation_config(config), f"{config}"
    overrides = settings.override_generation_config
    if overrides:
        fields |= checked_values(overrides, "model.override_generation_config")
        source = f"{source} with --override-generation-config"
    return GenerationDefaults(**fields, source=source)


def load_generation_defaults(settings: GenerationSettings) -> GenerationDefaults:
    """`generation_defaults(settings)`, logged once: an engine calls it when it starts. Defaults
    other than the engine's own are a warning, as vLLM's, so they show on a server's console
    (a Ray replica forwards warnings)."""
    defaults = generation_defaults(settings)
    log.log(logging.WARNING if defaults.given() else logging.INFO, defaults.describe())
    return defaults
