"""Reading and validating a LoRA adapter in PEFT's format, and its weights digest.

A PEFT adapter directory holds `adapter_config.json` (rank `r`, `lora_alpha`, `target_modules`,
`use_rslora`, ...) and `adapter_model.safetensors` with, per adapted linear layer,
`...layers.{i}.{self_attn|mlp}.{proj}.lora_A.weight` `[r, in]` and `...lora_B.weight` `[out, r]`.
The adapted layer computes `y = W x + scaling * B (A x)`, `scaling = alpha / r` (or
`alpha / sqrt(r)` with `use_rslora`).

Invariants of a returned `AdapterWeights`: every pair's shapes fit the base model (checked
against its `ModelSpec`), the rank is at most the caller's `max_rank`, every value is finite,
and `digest` is the same for byte-identical tensors and scaling whatever the directory, the
adapter's name or the key prefix PEFT wrote (it is what keys the KV cache, so two adapters that
change outputs differently never share a cached block and the same weights always do).
Every refusal is an `AdapterFormatError` (a ValueError) naming the problem.
"""

from __future__ import annotations

import hashlib
import json
import math
import pathlib
import re
import struct
from dataclasses import dataclass

import torch
from safetensors import SafetensorError, safe_open

from workers.config import ModelSpec

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
PROJECTIONS = ATTENTION_PROJECTIONS + MLP_PROJECTIONS
_TENSOR_NAME = re.compile(
    r"^(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(" + "|".join(PROJECTIONS) + r")\.lora_([AB])"
    r"(?:\.[^.]+)?\.weight$"
)
_DIGEST_DOMAIN = b"pagedserve.lora-weights.v1"


class AdapterFormatError(ValueError):
    """The adapter cannot be served as given; the message names the problem."""


@dataclass(frozen=True)
class LoRAPair:
    """One adapted projection: `a` `[r, in]`, `b` `[out, r]` (float32, unscaled)."""

    a: torch.Tensor
    b: torch.Tensor


@dataclass(frozen=True)
class AdapterWeights:
    """A validated adapter: pairs keyed by (layer, projection), its rank, scaling and digest."""

    rank: int
    scaling: float
    pairs: dict[tuple[int, str], LoRAPair]
    digest: str

    @property
    def target_modules(self) -> tuple[str, ...]:
        return tuple(p for p in PROJECTIONS if any(k[1] == p for k in self.pairs))


def projection_shape(spec: ModelSpec, projection: str) -> tuple[int, int]:
    """(out, in) of a projection of the base model (full, unsharded)."""
    q_rows = spec.num_heads * spec.head_dim
    kv_rows = spec.num_kv_heads * spec.head_dim
    shapes = {
        "q_proj": (q_rows, spec.hidden_size),
        "k_proj": (kv_rows, spec.hidden_size),
        "v_proj": (kv_rows, spec.hidden_size),
        "o_proj": (spec.hidden_size, q_rows),
        "gate_proj": (spec.intermediate_size, spec.hidden_size),
        "up_proj": (spec.intermediate_size, spec.hidden_size),
        "down_proj": (spec.hidden_size, spec.intermediate_size),
    }
    return shapes[projection]


def _read_config(directory: pathlib.Path) -> dict[str, object]:
    path = directory / CONFIG_FILE
    if not directory.is_dir():
        raise AdapterFormatError(f"adapter path {str(directory)!r} is not a directory")
    if not path.is_file():
        raise AdapterFormatError(f"adapter {str(directory)!r} has no {CONFIG_FILE}")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise AdapterFormatError(f"{CONFIG_FILE} is not valid JSON: {error}") from None
    if not isinstance(config, dict):
        raise AdapterFormatError(f"{CONFIG_FILE} must hold a JSON object")
    return config


def _check_config(config: dict[str, object], max_rank: int) -> tuple[int, float]:
    """Rank and scaling from the config; refuses what this server does not implement."""
    kind = config.get("peft_type", "LORA")
    if kind != "LORA":
        raise AdapterFormatError(f"peft_type {kind!r} is not LORA")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise AdapterFormatError(f"r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise AdapterFormatError(f"rank {rank} exceeds max_lora_rank {max_rank}")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise AdapterFormatError(f"lora_alpha must be a finite number, got {alpha!r}")
    for name in ("use_dora", "modules_to_save", "rank_pattern", "alpha_pattern"):
        if config.get(name):
            raise AdapterFormatError(f"{name} is not supported (got {config[name]!r})")
    if config.get("bias", "none") != "none":
        raise AdapterFormatError(f"bias {config['bias']!r} is not supported (only 'none')")
    targets = config.get("target_modules")
    if not isinstance(targets, list) or not targets:
        raise AdapterFormatError(
            f"target_modules must be a non-empty list of projection names, got {targets!r}"
        )
    unknown = sorted(str(t) for t in targets if t not in PROJECTIONS)
    if unknown:
        raise AdapterFormatError(
            f"unknown target modules {unknown} (supported: {list(PROJECTIONS)})"
        )
    use_rslora = bool(config.get("use_rslora", False))
    scaling = alpha / math.sqrt(rank) if use_rslora else alpha / rank
    return rank, float(scaling)


def _read_tensors(directory: pathlib.Path) -> dict[str, torch.Tensor]:
    path = directory / WEIGHTS_FILE
    if not path.is_file():
        raise AdapterFormatError(f"adapter {str(directory)!r} has no {WEIGHTS_FILE}")
    try:
        with safe_open(str(path), framework="pt") as handle:
            return {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
    except (SafetensorError, OSError, RuntimeError) as error:
        raise AdapterFormatError(f"{WEIGHTS_FILE} is truncated or corrupt: {error}") from None


def _pairs(
    tensors: dict[str, torch.Tensor], spec: ModelSpec, rank: int, targets: set[str]
) -> dict[tuple[int, str], LoRAPair]:
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _TENSOR_NAME.match(name)
        if match is None:
            raise AdapterFormatError(f"tensor {name!r} is not a LoRA A/B weight of a projection")
        layer, projection, half = int(match[1]), match[2], match[3]
        if not 0 <= layer < spec.num_layers:
            raise AdapterFormatError(
                f"tensor {name!r}: layer {layer} is outside the model's {spec.num_layers} layers"
            )
        if projection not in targets:
            raise AdapterFormatError(f"tensor {name!r}: {projection} is not in target_modules")
        if not tensor.is_floating_point():
            raise AdapterFormatError(f"tensor {name!r} has dtype {tensor.dtype}, not a float")
        out, inner = projection_shape(spec, projection)
        expected = (rank, inner) if half == "A" else (out, rank)
        if tuple(tensor.shape) != expected:
            raise AdapterFormatError(
                f"tensor {name!r} has shape {list(tensor.shape)} but rank {rank} on the base "
                f"model's {projection} ({out}x{inner}) needs {list(expected)}"
            )
        if not bool(torch.isfinite(tensor).all()):
            raise AdapterFormatError(f"tensor {name!r} has non-finite values")
        slot = halves.setdefault((layer, projection), {})
        if half in slot:
            raise AdapterFormatError(f"tensor {name!r}: layer {layer} {projection} twice")
        slot[half] = tensor
    pairs = {}
    for key, slot in sorted(halves.items()):
        if set(slot) != {"A", "B"}:
            missing = "B" if "A" in slot else "A"
            raise AdapterFormatError(f"layer {key[0]} {key[1]}: lora_{missing} is missing")
        pairs[key] = LoRAPair(slot["A"].to(torch.float32), slot["B"].to(torch.float32))
    if not pairs:
        raise AdapterFormatError(f"{WEIGHTS_FILE} holds no LoRA weights")
    return pairs


def adapter_digest(
    tensors: dict[tuple[int, str], LoRAPair], scaling: float, originals: dict[str, torch.Tensor]
) -> str:
    """Hex SHA-256 over the canonical tensor names (layer, projection, A/B), the original
    dtypes, shapes and bytes in sorted order, plus the scaling (it changes the outputs)."""
    digest = hashlib.sha256(_DIGEST_DOMAIN)
    digest.update(struct.pack("<d", scaling))
    for (layer, projection), _pair in sorted(tensors.items()):
        for half in ("A", "B"):
            tensor = originals[f"{layer}.{projection}.{half}"]
            digest.update(f"{layer}.{projection}.lora_{half}".encode() + b"\0")
            digest.update(str(tensor.dtype).encode() + b"\0")
            digest.update(struct.pack(f"<{tensor.dim()}q", *tensor.shape))
            data = tensor.contiguous().reshape(-1).view(torch.uint8)
            digest.update(data.numpy().tobytes())
    return digest.hexdigest()


def load_peft_adapter(path: str | pathlib.Path, spec: ModelSpec, max_rank: int) -> AdapterWeights:
    """The adapter at `path`, validated against the base model `spec` (full, unsharded).

    Raises AdapterFormatError naming the problem: a missing file, bad JSON, a rank above
    `max_rank`, an unknown or unsupported target module or option, a tensor whose shape does not
    fit the base layer, or non-finite weights."""
    directory = pathlib.Path(path)
    config = _read_config(directory)
    rank, scaling = _check_config(config, max_rank)
    tensors = _read_tensors(directory)
    targets = {str(t) for t in config["target_modules"]}  # type: ignore[union-attr]
    pairs = _pairs(tensors, spec, rank, targets)
    originals: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        match = _TENSOR_NAME.match(name)
        assert match is not None
        originals[f"{int(match[1])}.{match[2]}.{match[3]}"] = tensor
    return AdapterWeights(rank, scaling, pairs, adapter_digest(pairs, scaling, originals))
