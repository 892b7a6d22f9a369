"""From a model path to a loaded model shard: describe the model, then load one rank's weights.

`describe_model` is cheap enough for the driver (reads metadata, hashes the weights once, then
remembers the digest); `load_model_shard` runs on each rank and reads only that rank's rows and
columns (for GGUF, from the dequantized cache it builds on first use; with
`quantized_activations` or `quantized_decode` also the file's block codes, `workers.gguf_blocks`,
for the layers that keep them).
"""

from __future__ import annotations

import functools
import pathlib
from dataclasses import dataclass

import torch

from workers.checkpoint import CheckpointReader, safetensors_files
from workers.config import ModelSpec
from workers.families import family_named
from workers.gguf_blocks import GgufBlockSource
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


@dataclass(frozen=True)
class ModelMetadata:
    """What a model's metadata alone tells (no weights read, no digest)."""

    spec: ModelSpec
    quantization: str


def read_metadata(path: pathlib.Path) -> ModelMetadata:
    """The architecture and quantization of the model at `path` from its metadata only: what
    config checks need before any replica starts. Refuses, with a ValueError naming the field
    and what is supported, an architecture we do not run, a GGUF tensor type we cannot read and
    a quantized HF checkpoint. Reads the GGUF header once (parsing it is the slow part)."""
    if is_gguf(path):
        try:
            stat = path.stat()
        except OSError:
            open_gguf(path)  # raises the ValueError naming the file
            raise
        return _gguf_metadata(str(path.resolve()), stat.st_ino, stat.st_size, stat.st_mtime_ns)
    _check_hf_quantization(path)
    return ModelMetadata(spec_from_hf_directory(path), "none")


@functools.lru_cache(maxsize=32)
def _gguf_metadata(resolved: str, inode: int, size: int, mtime_ns: int) -> ModelMetadata:
    """The GGUF file's metadata, remembered per (path, inode, size, mtime): parsing the header
    steps over every vocabulary entry, and config checks, the driver and each replica ask again
    for the same file. A refusal raises, remembering nothing."""
    reader = open_gguf(pathlib.Path(resolved))
    check_tensor_types(reader)
    return ModelMetadata(spec_from_gguf(reader), quantization_name(reader))


def read_spec(path: pathlib.Path) -> ModelSpec:
    """`read_metadata(path).spec`."""
    return read_metadata(path).spec


def describe_model(
    path: pathlib.Path, cache_root: pathlib.Path, metadata: ModelMetadata | None = None
) -> ModelDescription:
    """Spec, quantization and weights digest of the model at `path` (a .gguf or HF directory);
    `metadata` when the caller has read it already."""
    metadata = metadata if metadata is not None else read_metadata(path)
    if not is_gguf(path):
        safetensors_files(path)
    return ModelDescription(
        path, metadata.spec, metadata.quantization, weights_digest(path, cache_root)
    )


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
    blocks = None
    if is_gguf(description.path):
        files = [
            ensure_dequantized_cache(
                description.path, description.spec, description.weights_digest, cache_root
            )
        ]
        if quantized_activations or quantized_decode:  # the layers keep the file's own codes
            blocks = GgufBlockSource(open_gguf(description.path), description.spec)
    else:
        files = safetensors_files(description.path)
    with torch.device(device):
        model = CausalLM(description.spec, tp, dtype, quantized_decode, quantized_activations)
    family = family_named(description.spec.architecture)
    with CheckpointReader(files, blocks) as checkpoint:
        view = family.checkpoint_view(checkpoint, description.spec)
        model.load(partial_rotary_view(view, description.spec))
    return model.eval()
