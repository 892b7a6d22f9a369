"""vLLM's engine arguments that have no field of their own in `EngineConfig`, read once for
`LLM(...)` keywords and `pagedserve serve` / `pagedserve generate` flags alike, so a vLLM
script or command line runs unchanged where the meaning carries over and fails with a reason
where it does not.

- `swap_space` (GiB of CPU memory for swapped-out KV blocks) is `cache.swap_space_bytes`.
- `enforce_eager`, `trust_remote_code`, `disable_log_stats` and `disable_log_requests` change
  nothing here, and are accepted as booleans: every step already runs eagerly (no CUDA graphs
  are captured), model architectures are built in (no model code is downloaded or run), and the
  engine logs neither periodic statistics nor each request (metrics are read on demand).
- `quantization` and `pipeline_parallel_size` are accepted at the one value that describes
  this engine (None or "gguf"; 1); another value is a ConfigError saying why, never silently
  ignored. (`kv_cache_dtype` is `cache.kv_cache_dtype`, a setting of its own.)

Invariant: a name here is never also an `EngineConfig` field, so each setting has one spelling
per section and the two translations (keywords, flags) cannot disagree.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from cluster.engine.errors import ConfigError

GIB = 2**30

ACCEPTED_AS_IS: dict[str, str] = {
    "enforce_eager": "every step already runs eagerly: no CUDA graphs are captured",
    "trust_remote_code": "model architectures are built in: no model code is downloaded or run",
    "disable_log_stats": "the engine logs no periodic statistics (GET /metrics serves them)",
    "disable_log_requests": "requests are not logged one by one",
}
"""Boolean vLLM arguments with nothing to change here, and why."""

ONE_VALUE: dict[str, tuple[tuple[Any, ...], str]] = {
    "quantization": (
        (None, "gguf"),
        "weights are used as stored: a GGUF file's quantized codes, or the dtype of an HF "
        "checkpoint",
    ),
    "pipeline_parallel_size": ((1,), "one pipeline stage; split a model with tensor_parallel_size"),
}
"""vLLM arguments accepted only at the values that describe this engine, and why."""

NAMES = frozenset(ACCEPTED_AS_IS) | frozenset(ONE_VALUE) | {"swap_space"}
"""Every vLLM argument this module reads."""

FLAG_GROUP = "vllm"


def vllm_overrides(values: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """`{section: {field: value}}` for the vLLM arguments in `values` (every key must be in
    `NAMES`); raises ConfigError naming the argument when a value has no meaning here."""
    overrides: dict[str, dict[str, Any]] = {}
    for name, value in values.items():
        if name == "swap_space":
            if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
                raise ConfigError(
                    f"swap_space: GiB of CPU memory for swapped-out KV blocks, a number >= 0; "
                    f"got {value!r}"
                )
            overrides.setdefault("cache", {})["swap_space_bytes"] = int(value * GIB)
        elif name in ACCEPTED_AS_IS:
            if not isinstance(value, bool):
                raise ConfigError(f"{name}: true or false; got {value!r}")
        elif name in ONE_VALUE:
            allowed, why = ONE_VALUE[name]
            if isinstance(value, bool) or value not in allowed:
                shown = " or ".join(repr(v) for v in allowed)
                raise ConfigError(f"{name}={value!r} is not supported: {why} (accepted: {shown})")
        else:
            raise ConfigError(f"{name!r} is not a vLLM argument this engine reads")
    return overrides


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """vLLM's flags for the arguments above (`--swap-space 4`, `--enforce-eager`, `-q gguf`,
    ...), stored as `vllm.NAME` for `config_flags.section_values(args, "vllm")` to read back."""
    group = parser.add_argument_group(
        "vLLM compatibility", "vLLM's flags without a setting of their own here"
    )
    group.add_argument(
        "--swap-space",
        dest=f"{FLAG_GROUP}.swap_space",
        type=float,
        default=None,
        metavar="GIB",
        help="CPU memory for swapped-out KV blocks, in GiB (sets --swap-space-bytes)",
    )
    for name, why in ACCEPTED_AS_IS.items():
        group.add_argument(
            "--" + name.replace("_", "-"),
            dest=f"{FLAG_GROUP}.{name}",
            action="store_true",
            default=None,
            help=f"accepted; changes nothing: {why}",
        )
    short = {"quantization": "-q", "pipeline_parallel_size": "-pp"}
    for name, (allowed, why) in ONE_VALUE.items():
        spellings = ["--" + name.replace("_", "-")] + ([short[name]] if name in short else [])
        group.add_argument(
            *spellings,
            dest=f"{FLAG_GROUP}.{name}",
            type=int if name == "pipeline_parallel_size" else str,
            default=None,
            help=f"only {' or '.join(repr(v) for v in allowed if v is not None)}: {why}",
        )


def merge_overrides(
    overrides: dict[str, dict[str, Any]], translated: dict[str, dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """`overrides` with the translated vLLM arguments added; raises ConfigError when a setting
    is given both ways (`swap_space` and `swap_space_bytes`)."""
    merged = {section: dict(values) for section, values in overrides.items()}
    for section, values in translated.items():
        for field, value in values.items():
            if field in merged.get(section, {}):
                raise ConfigError(
                    f"{section}.{field} is given twice (once through vLLM's spelling); give one"
                )
            merged.setdefault(section, {})[field] = value
    return merged
