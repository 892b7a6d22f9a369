"""GGUF models: metadata -> `ModelSpec`, and a dequantized safetensors cache keyed by digest.

The first start dequantizes every tensor (with the `gguf` package) into float32 under HF names,
undoing llama.cpp's Q/K row permutation for `llama`/`mistral` files, and writes
`<cache>/<weights digest>/model.safetensors` atomically (under a file lock, so concurrent ranks
build it once). Later starts and every rank then read only their shard from that file.
"""

from __future__ import annotations

import collections
import fcntl
import os
import pathlib
from dataclasses import replace
from typing import Any

import gguf
import numpy as np
import torch
from safetensors.torch import save_file

from workers.config import ModelSpec, RopeSpec
from workers.families import Family, family_named, gguf_family
from workers.gguf_header import GgufHeader, GgufMetadata, read_gguf_header

GLOBAL_TENSOR_NAMES: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def open_gguf(path: pathlib.Path) -> GgufHeader:
    """The header and tensors of `path` (`read_gguf_header`: milliseconds, where
    `gguf.GGUFReader` walks the whole vocabulary); a truncated or corrupt file raises a
    ValueError naming it."""
    try:
        return read_gguf_header(path)
    except (ValueError, OSError) as error:
        raise ValueError(f"GGUF file {path} is truncated or corrupt: {error}") from error


def _field(reader: GgufMetadata, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _rope_from_gguf(reader: GgufMetadata, arch: str) -> RopeSpec:
    theta = float(_field(reader, f"{arch}.rope.freq_base", 10000.0))
    if any(tensor.name == "rope_freqs.weight" for tensor in reader.tensors):
        raise ValueError(
            "GGUF rope_freqs tensor (llama3 rope scaling) is not supported; load the HF directory"
        )
    kind = str(_field(reader, f"{arch}.rope.scaling.type", "none"))
    factor = float(_field(reader, f"{arch}.rope.scaling.factor", 1.0))
    original = int(_field(reader, f"{arch}.rope.scaling.original_context_length", 0))
    factors = {t.name: t for t in reader.tensors if t.name.startswith("rope_factors_")}
    if factors:
        return _longrope_from_gguf(reader, arch, theta, original, factors)
    if kind == "none" or factor == 1.0:
        return RopeSpec(theta=theta)
    if kind == "linear":
        return RopeSpec(theta=theta, kind="linear", factor=factor)
    if kind == "yarn":
        return RopeSpec(
            theta=theta,
            kind="yarn",
            factor=factor,
            original_max_position_embeddings=original,
            attention_factor=0.1 * float(np.log(factor)) + 1.0,
        )
    raise ValueError(f"GGUF rope scaling type {kind!r} is not supported")


def _longrope_from_gguf(
    reader: GgufMetadata, arch: str, theta: float, original: int, factors: dict[str, Any]
) -> RopeSpec:
    """LongRoPE as llama.cpp writes it (Phi-3): `rope_factors_short` / `rope_factors_long`
    tensors, `rope.scaling.attn_factor` and the original context length."""
    if set(factors) != {"rope_factors_short.weight", "rope_factors_long.weight"} or original <= 0:
        raise ValueError(
            "GGUF LongRoPE needs rope_factors_short and rope_factors_long tensors and "
            f"{arch}.rope.scaling.original_context_length"
        )
    short, long = (
        tuple(float(x) for x in np.asarray(factors[f"rope_factors_{kind}.weight"].data).ravel())
        for kind in ("short", "long")
    )
    context = int(_field(reader, f"{arch}.context_length", original))
    factor = context / original
    attention = _field(reader, f"{arch}.rope.scaling.attn_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else float(np.sqrt(1 + np.log(factor) / np.log(original)))
    return RopeSpec(
        theta=theta,
        kind="longrope",
        factor=factor,
        original_max_position_embeddings=original,
        attention_factor=float(attention),
        short_factor=short,
        long_factor=long,
    )


def spec_from_gguf(reader: GgufMetadata) -> ModelSpec:
    """The model description of a GGUF file's metadata."""
    arch_name = str(_field(reader, "general.architecture", ""))

    def metadata(key: str, default: Any) -> Any:
        return _field(reader, key, default)

    family = gguf_family(arch_name, metadata)

    shapes = {tensor.name: tensor.shape for tensor in reader.tensors}
    if "token_embd.weight" not in shapes:
        raise ValueError("GGUF file has no token_embd.weight tensor")
    if family.gguf_experts and "blk.0.ffn_gate_exps.weight" not in shapes:
        raise ValueError(
            f"GGUF {arch_name}.expert_count is set but blk.0.ffn_gate_exps.weight is missing: "
            "only expert stacks (blk.N.ffn_{gate,up,down}_exps) are supported, not one tensor "
            "per expert (blk.N.ffn_gate.E.weight, older llama.cpp files); convert it again"
        )
    hidden = int(_field(reader, f"{arch_name}.embedding_length"))
    heads = int(_field(reader, f"{arch_name}.attention.head_count"))
    layers = int(_field(reader, f"{arch_name}.block_count"))
    vocab = int(_field(reader, f"{arch_name}.vocab_size", int(shapes["token_embd.weight"][1])))
    eos: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
        value = _field(reader, key)
        if value is not None and int(value) not in eos:
            eos.append(int(value))
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    head_dim = _field(reader, f"{arch_name}.attention.key_length") or hidden // heads
    rope = _rope_from_gguf(reader, arch_name)
    rotary_dim = _field(reader, f"{arch_name}.rope.dimension_count")
    if rotary_dim and int(rotary_dim) < int(head_dim):
        rope = replace(rope, partial_rotary_factor=int(rotary_dim) / int(head_dim))
    return ModelSpec(
        architecture=family.name,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(
            _field(reader, f"{arch_name}.feed_forward_length")
            or _field(reader, f"{arch_name}.expert_feed_forward_length")
        ),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(_field(reader, f"{arch_name}.attention.head_count_kv", heads)),
        head_dim=int(head_dim),
        rms_norm_eps=float(_field(reader, f"{arch_name}.attention.layer_norm_rms_epsilon", 1e-6)),
        max_position_embeddings=int(_field(reader, f"{arch_name}.context_length", 2048)),
        rope=rope,
        attention_bias="blk.0.attn_q.bias" in shapes,
        mlp_bias=False,
        tie_word_embeddings="output.weight" not in shapes,
        layer_sliding_windows=tuple(family.sliding_windows_from_gguf(metadata, layers)),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(eos),
        variant=family.variant_from_gguf(metadata, layers, rope),
    )


READABLE_TYPES = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)  # fmt: skip
"""GGUF tensor types we dequantize (with the `gguf` package): Q4_K_M and Q5_K_M files are
mixes of these."""


def check_tensor_types(reader: GgufMetadata) -> None:
    """Raise a ValueError naming the first tensor whose type is not in `READABLE_TYPES`."""
    for tensor in reader.tensors:
        if tensor.tensor_type.name not in READABLE_TYPES:
            raise ValueError(
                f"GGUF tensor {tensor.name!r} has type {tensor.tensor_type.name}, which is not "
                f"supported (supported: {', '.join(READABLE_TYPES)})"
            )


def quantization_name(reader: GgufMetadata) -> str:
    """`gguf:<type>` of the most common tensor type among the matrices (e.g. `gguf:Q4_1`)."""
    counts = collections.Counter(
        tensor.tensor_type.name for tensor in reader.tensors if len(tensor.shape) > 1
    )
    return f"gguf:{counts.most_common(1)[0][0]}" if counts else "gguf:F32"


def hf_name(gguf_name: str, family: Family) -> str | None:
    """The HF parameter name of a GGUF tensor name (None for tensors the model does not use)."""
    if gguf_name in GLOBAL_TENSOR_NAMES:
        return GLOBAL_TENSOR_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    layer_names = family.gguf_layer_tensors()
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}"
    return None


def unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: per head (pair, 2) -> (2, pair), rotate-half order."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    restored = weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2)
    return restored.reshape(weight.shape)


def dequantized_tensors(reader: GgufMetadata, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Every used tensor dequantized to float32 under its HF name, Q/K rows in HF order."""
    family = family_named(spec.architecture)  # the one `spec_from_gguf` found
    permuted = family.gguf_qk_permuted
    tensors: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name, family)
        if name is None:
            continue
        try:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as error:
            raise ValueError(
                f"GGUF tensor {tensor.name!r} has unsupported type {tensor.tensor_type.name}"
            ) from error
        values = np.asarray(values, dtype=np.float32)
        if permuted and tensor.name.endswith(("attn_q.weight", "attn_q.bias")):
            values = unpermute_rows(values, spec.num_heads)
        elif permuted and tensor.name.endswith(("attn_k.weight", "attn_k.bias")):
            values = unpermute_rows(values, spec.num_kv_heads)
        if ".*." in name:  # an expert stack: one tensor per expert under its HF name
            for expert, matrix in enumerate(values):
                copied = np.array(matrix, dtype=np.float32, order="C", copy=True)
                tensors[name.replace(".*.", f".{expert}.")] = torch.from_numpy(copied)
            continue
        tensors[name] = torch.from_numpy(np.array(values, dtype=np.float32, order="C", copy=True))
    return tensors


def ensure_dequantized_cache(
    path: pathlib.Path, spec: ModelSpec, digest: str, cache_root: pathlib.Path
) -> pathlib.Path:
    """The cached `model.safetensors` for `digest`, building it once under a file lock."""
    target = cache_root / digest / "model.safetensors"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(cache_root / f"{digest}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not target.is_file():
                partial = target.with_suffix(f".partial.{os.getpid()}")
                save_file(dequantized_tensors(open_gguf(path), spec), str(partial))
                os.replace(partial, target)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return target
