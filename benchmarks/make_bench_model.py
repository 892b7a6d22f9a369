"""A benchmark model of the size people deploy: Llama-3.2-1B's shape, random weights, GGUF Q4_K_M.

``python -m benchmarks.make_bench_model [--out DIR]`` prints the path of
``DIR/bench-llama-1b-Q4_K_M.gguf``, building it once (the default DIR is
``$XDG_CACHE_HOME/pagedserve-bench/llama-1b-seed<seed>``, ``~/.cache`` by default; a file
already there is reused). The serving and offline benchmarks take it with ``--model PATH``.

The recipe:

- the shape of Llama-3.2-1B (``SHAPE``, a ``transformers.LlamaConfig``): hidden 2048, 16 layers,
  32 query and 8 KV heads of 64, MLP 8192, tied embeddings; the vocabulary, tokenizer and chat
  template of the shipped SmolLM2 (49152 ids, copied from its GGUF metadata), so the chat loads
  render the same way on every server;
- weights drawn from a fixed seed, one ``torch.Generator`` per tensor (``seed`` plus the
  tensor's index), normal with standard deviation ``1 / sqrt(fan_in)`` for the layers' matrices
  (each layer moves the residual stream by about as much as it holds, so the output depends on
  the whole context rather than repeating its last token), ``EMBED_STD`` for the tied
  embedding (logits with a standard deviation of about 2), norms of ones: finite and
  non-degenerate in float16;
- written with the ``gguf`` package as a float16 GGUF (norms float32), streamed a tensor at a
  time, then ``llama-quantize ... Q4_K_M`` (llama.cpp's own mix: Q4_K, with Q6_K for the head
  and for half the layers' ``attn_v`` and ``ffn_down``). The float16 file is deleted unless
  ``--keep-f16``.

``llama-quantize`` is found as ``benchmarks.llama_server`` finds its tools: ``--llama-quantize``,
else ``$PAGEDSERVE_LLAMA_QUANTIZE``, else beside the ``llama-server`` it finds
(``$PAGEDSERVE_LLAMA_SERVER``, its build cache, PATH).

Invariant: the same seed gives the same float16 file, byte for byte; the quantized file is
llama-quantize's deterministic function of it.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import torch
import transformers

from benchmarks import llama_server

SHAPE = transformers.LlamaConfig(
    vocab_size=49152,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    tie_word_embeddings=True,
)
"""Llama-3.2-1B's shape (its llama3 rope scaling left out: a GGUF carries it as a tensor we do
not read) with SmolLM2's vocabulary."""
EMBED_STD = 0.05
"""Standard deviation of the tied embedding: RMS-normed hidden states times it give logits with
a standard deviation of about `EMBED_STD * sqrt(hidden)` (2.3 at 2048)."""
QUANT_TYPE = "Q4_K_M"
LAYER_MATRICES = (
    ("attn_q", "num_attention_heads", "hidden_size"),
    ("attn_k", "num_key_value_heads", "hidden_size"),
    ("attn_v", "num_key_value_heads", "hidden_size"),
    ("attn_output", "hidden_size", "q_width"),
    ("ffn_gate", "intermediate_size", "hidden_size"),
    ("ffn_up", "intermediate_size", "hidden_size"),
    ("ffn_down", "hidden_size", "intermediate_size"),
)
"""Each layer's matrices in GGUF order: name, rows, columns (heads count `head_dim` rows)."""


def default_out_dir(seed: int) -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pagedserve-bench" / f"llama-1b-seed{seed}"


def model_file(out: Path) -> Path:
    return out / f"bench-llama-1b-{QUANT_TYPE}.gguf"


def _size(config: transformers.LlamaConfig, what: str) -> int:
    if what == "q_width":
        return config.num_attention_heads * config.head_dim
    if what.startswith("num_"):
        return getattr(config, what) * config.head_dim
    return getattr(config, what)


def tensor_plan(config: transformers.LlamaConfig) -> Iterator[tuple[str, tuple[int, ...], float]]:
    """(GGUF name, numpy shape, standard deviation; 0 means a norm of ones) for every tensor."""
    yield "token_embd.weight", (config.vocab_size, config.hidden_size), EMBED_STD
    for layer in range(config.num_hidden_layers):
        yield f"blk.{layer}.attn_norm.weight", (config.hidden_size,), 0.0
        for name, rows, cols in LAYER_MATRICES:
            shape = (_size(config, rows), _size(config, cols))
            yield f"blk.{layer}.{name}.weight", shape, 1.0 / math.sqrt(shape[1])
        yield f"blk.{layer}.ffn_norm.weight", (config.hidden_size,), 0.0
    yield "output_norm.weight", (config.hidden_size,), 0.0


def tensor_values(shape: tuple[int, ...], std: float, seed: int) -> np.ndarray:
    """float16 normal values (float32 ones for a norm), from a generator of their own."""
    if std == 0.0:
        return np.ones(shape, dtype=np.float32)
    generator = torch.Generator().manual_seed(seed)
    values = torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=generator)
    return values.to(torch.float16).numpy()


def add_metadata(writer: gguf.GGUFWriter, config: transformers.LlamaConfig) -> None:
    """The llama hyperparameters of `config` and the shipped model's tokenizer fields."""
    from workers.model_source import resolve_model_path

    writer.add_name("pagedserve bench Llama-3.2-1B shape (random weights)")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    shipped = gguf.GGUFReader(str(resolve_model_path("default")))
    for key, field in shipped.fields.items():
        if key.startswith("tokenizer."):
            sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type)


def write_f16(path: Path, config: transformers.LlamaConfig, seed: int) -> Path:
    """The float16 GGUF of the recipe, written one tensor at a time."""
    writer = gguf.GGUFWriter(str(path), "llama")
    add_metadata(writer, config)
    plan = list(tensor_plan(config))
    for name, shape, std in plan:
        dtype = np.dtype(np.float32 if std == 0.0 else np.float16)
        writer.add_tensor_info(name, shape, dtype, int(np.prod(shape)) * dtype.itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for index, (_, shape, std) in enumerate(plan):
        writer.write_tensor_data(tensor_values(shape, std, seed + index))
    writer.close()
    return path


def find_llama_quantize(explicit: str | None) -> Path | None:
    return llama_server.find_llama_tool("llama-quantize", explicit, "PAGEDSERVE_LLAMA_QUANTIZE")


def build(out: Path, seed: int, quantize: Path, keep_f16: bool) -> Path:
    """`model_file(out)`, written from the recipe unless it exists."""
    target = model_file(out)
    if target.is_file():
        return target
    out.mkdir(parents=True, exist_ok=True)
    f16 = out / "bench-llama-1b-F16.gguf"
    if not f16.is_file():
        partial = f16.with_suffix(f".partial.{os.getpid()}")
        write_f16(partial, SHAPE, seed)
        os.replace(partial, f16)
    partial = target.with_suffix(f".partial.{os.getpid()}")
    subprocess.run([str(quantize), str(f16), str(partial), QUANT_TYPE], check=True)
    os.replace(partial, target)
    if not keep_f16:
        f16.unlink()
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="the cache directory (default: per seed)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--llama-quantize", help="the binary (else $PAGEDSERVE_LLAMA_QUANTIZE)")
    parser.add_argument("--keep-f16", action="store_true", help="keep the float16 GGUF")
    args = parser.parse_args(argv)
    out = args.out or default_out_dir(args.seed)
    target = model_file(out)
    if not target.is_file():
        quantize = find_llama_quantize(args.llama_quantize)
        if quantize is None:
            print(
                "make_bench_model: llama-quantize not found (give --llama-quantize, set "
                "PAGEDSERVE_LLAMA_QUANTIZE, or build llama.cpp beside llama-server)",
                file=sys.stderr,
            )
            return 1
        target = build(out, args.seed, quantize, args.keep_f16)
    print(target)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
