"""From a model path to a loaded model shard: describe the model, then load one rank's weights.

`describe_model` is cheap enough for the driver (reads metadata, hashes the weights once, then
remembers the digest); `load_model_shard` runs on each rank and reads only that rank's rows and
columns (for GGUF, from the dequantized cache it builds on first use).
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass

import torch

from workers.checkpoint import CheckpointReader, safetensors_files
from workers.config import ModelSpec
from workers.families import family_named
from workers.gguf_weights import (
    check_tensor_types,
    ensure_dequantized_cache,
    open_gguf,
    quantization_name,
    spec_from_gguf,
)
from workers.model import CausalLM
from workers.model_source import is_gguf, spec_from_hf_directory
from workers.parallel import TensorParallel
from workers.partial_rotary import partial_rotary_view
from workers.weights_digest import weights_digest


@dataclass(frozen=True)
class ModelDescription:
    """What a model is, before any weights are loaded."""

    path: pathlib.Path
    spec: ModelSpec
    quantization: str
    weights_digest: str


def _check_hf_quantization(directory: pathlib.Path) -> None:
    text = (directory / "config.json").read_text()
    if '"quantization_config"' in text:
        raise ValueError(
            f"{directory / 'config.json'}: quantized HF checkpoints are not supported "
            "(use unquantized safetensors or a GGUF file)"
        )


def read_spec(path: pathlib.Path) -> ModelSpec:
    """The architecture of the model at `path` from its metadata only (no weights read, no
    digest): what config checks need before any replica starts."""
    if is_gguf(path):
        return spec_from_gguf(open_gguf(path))
    return spec_from_hf_directory(path)


def describe_model(path: pathlib.Path, cache_root: pathlib.Path) -> ModelDescription:
    """Spec, quantization and weights digest of the model at `path` (a .gguf or HF directory)."""
    if is_gguf(path):
        reader = open_gguf(path)
        check_tensor_types(reader)
        spec = spec_from_gguf(reader)
        quantization = quantization_name(reader)
    else:
        _check_hf_quantization(path)
        spec = spec_from_hf_directory(path)
        safetensors_files(path)
        quantization = "none"
    return ModelDescription(path, spec, quantization, weights_digest(path, cache_root))


def load_model_shard(
    description: ModelDescription,
    tp: TensorParallel,
    dtype: torch.dtype,
    device: torch.device,
    cache_root: pathlib.Path,
    quantized_decode: bool = True,
    quantized_activations: bool = False,
) -> CausalLM:
    """Rank `tp.rank`'s shard of the model on `device` in `dtype`, weights loaded
    (`quantized_decode`, `quantized_activations`: see `CausalLM`)."""
    if is_gguf(description.path):
        files = [
            ensure_dequantized_cache(
                description.path, description.spec, description.weights_digest, cache_root
            )
        ]
    else:
        files = safetensors_files(description.path)
    with torch.device(device):
        model = CausalLM(description.spec, tp, dtype, quantized_decode, quantized_activations)
    family = family_named(description.spec.architecture)
    with CheckpointReader(files) as checkpoint:
        view = family.checkpoint_view(checkpoint, description.spec)
        model.load(partial_rotary_view(view, description.spec))
    return model.eval()
