"""`pagedserve serve`'s model and engine flags, as `vllm serve` spells them.

`pagedserve serve MODEL` takes the model (a `.gguf` file or an HF directory) as its positional
argument, `--served-model-name` the name clients send, and every engine setting as a flag
generated from `cluster.engine.config.EngineConfig`'s sections (`--dtype`, `--max-model-len`,
`--max-num-seqs`, `--tensor-parallel-size`, `--enable-expert-parallel`,
`--enable-prefix-caching` / `--no-enable-prefix-caching`, ...; `EngineConfig.add_section_groups`
is their one definition). The LoRA section's flags belong to the LoRA group
(`cli_serve.add_lora_arguments`).

Invariants: a flag given replaces that one field of every application's `engine` args and
leaves the rest of the config file as it is; the values written are the ones the engine will
read (coerced and validated with the whole engine section, so a bad value is a ConfigError
naming `section.field`); a model given on the command line that is not the config's runs with
its own context (the file's `model.max_model_len` was its model's) unless `--max-model-len` is
given, and without `--served-model-name` it is also the served name (vLLM's default), except
"default", which keeps the config's name.
"""

from __future__ import annotations

import argparse
from typing import Any

from cluster.engine.config import EngineConfig
from cluster.engine.config_flags import section_values
from cluster.engine.errors import ConfigError
from cluster.engine.vllm_args import (
    FLAG_GROUP,
    add_vllm_flags,
    merge_overrides,
    vllm_overrides,
)
from cluster.serving.pd_config import ENGINE_DEPLOYMENTS
from workers.model_source import resolve_model_path

SECTIONS_ELSEWHERE = ("lora",)
"""Engine sections whose flags another group of `pagedserve serve` defines."""


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The positional model, `--served-model-name` and the engine sections' flags."""
    parser.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="the model to serve: a .gguf file, an HF directory (config.json + *.safetensors) "
        "or 'default' (default: the config's engine.model.model)",
    )
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the name clients put in the `model` field (default: the MODEL given, else the "
        "config's served_model_name); one name (vLLM's aliases are refused)",
    )
    EngineConfig.add_section_groups(
        parser, exclude=SECTIONS_ELSEWHERE, default_source="the config file's"
    )
    add_vllm_flags(parser)


def given_model(args: argparse.Namespace) -> str | None:
    """The model named on the command line (positional or `--model`), or None."""
    positional = args.model_tag
    flagged = section_values(args, "model").get("model")
    if positional is not None and flagged is not None and positional != flagged:
        raise ConfigError(
            f"the model is given twice: MODEL {positional!r} and --model {flagged!r}; give one"
        )
    return positional if positional is not None else flagged


def engine_overrides(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """`{section: {field: raw value}}` of the engine flags given (MODEL as `model.model`)."""
    overrides: dict[str, dict[str, Any]] = {}
    for section in EngineConfig.section_names():
        if section in SECTIONS_ELSEWHERE:
            continue
        values = section_values(args, section)
        if values:
            overrides[section] = values
    model = given_model(args)
    if model is not None:
        overrides.setdefault("model", {})["model"] = model
    return merge_overrides(overrides, vllm_overrides(section_values(args, FLAG_GROUP)))


def apply_engine_flags(config: dict[str, Any], args: argparse.Namespace) -> None:
    """Writes the model and engine flags given into every application's args (see the module
    doc). A tensor-parallel degree above 1 on a config whose `parallel.backend` is "local" (one
    in-process rank) switches that application to "ray" (one rank actor each) unless
    `--backend` is given."""
    overrides = engine_overrides(args)
    model = given_model(args)
    names = args.served_model_name
    if names is not None and len(names) != 1:
        raise ConfigError(
            f"--served-model-name: one name is served, got {len(names)}: {names} (give MODEL "
            "before it: pagedserve serve MODEL --served-model-name NAME)"
        )
    for app in config.get("applications", []):
        app_args = app.setdefault("args", {})
        if names is not None:
            app_args["served_model_name"] = names[0]
        elif model is not None and model != "default":
            app_args["served_model_name"] = model
        if not overrides:
            continue
        engine = app_args.get("engine") or {}
        app_args["engine"] = overridden_engine(engine, overrides)
        if backend_of(engine) == "local" and backend_of(app_args["engine"]) == "ray":
            release_replica_cpus(app)


def backend_of(engine: dict[str, Any]) -> str | None:
    return (engine.get("parallel") or {}).get("backend")


def release_replica_cpus(app: dict[str, Any]) -> None:
    """An engine replica whose ranks became Ray actors only drives them: each rank's bundle
    holds a CPU, so the replica asks for none (else TP = 2 would need three CPUs on two)."""
    for deployment in app.get("deployments", []):
        if deployment.get("name") in ENGINE_DEPLOYMENTS:
            deployment.setdefault("ray_actor_options", {})["num_cpus"] = 0


def overridden_engine(
    engine: dict[str, Any], overrides: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """`engine` with each given field replaced by its coerced value (the other fields as the
    config has them); raises ConfigError naming the field when the result is not valid."""
    merged = {section: dict(values or {}) for section, values in engine.items()}
    model_flags = overrides.get("model", {})
    configured_model = merged.get("model", {}).get("model", "default")
    another_model = not same_model(model_flags.get("model", configured_model), configured_model)
    if another_model and "max_model_len" not in model_flags:  # the file's was its model's
        merged.get("model", {}).pop("max_model_len", None)
    for section, values in overrides.items():
        merged.setdefault(section, {}).update(values)
    parallel_flags = overrides.get("parallel", {})
    ranks = parallel_flags.get("tensor_parallel_size")
    parallel = merged.get("parallel", {})
    one_rank_only = parallel.get("backend") == "local" and "backend" not in parallel_flags
    if ranks is not None and str(ranks).strip() != "1" and one_rank_only:
        parallel["backend"] = "ray"
    validated = EngineConfig.build(merged).model_dump()
    for section, values in overrides.items():
        for field in values:
            merged[section][field] = validated[section][field]
    return merged


def same_model(first: str, second: str) -> bool:
    """Whether two `model.model` values name the same file or directory ("default" and the
    path it resolves to do); names that do not resolve are compared as given."""
    if first == second:
        return True
    try:
        return resolve_model_path(first).resolve() == resolve_model_path(second).resolve()
    except ValueError:
        return False
