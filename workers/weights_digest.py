"""The weights digest: SHA-256 over the weight files' names and bytes, memoized by file stat.

The digest identifies the weights in the KV cache identity and keys the dequantized GGUF cache.
Hashing a large checkpoint takes seconds, so the result is remembered in the cache directory
under a key of (path, size, mtime) of every file: a changed file gets a fresh digest.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib

from workers.checkpoint import safetensors_files
from workers.model_source import is_gguf

CHUNK_BYTES = 8 * 2**20


def default_cache_root() -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(pathlib.Path.home() / ".cache")
    return pathlib.Path(base) / "pagedserve" / "weights"


def weight_files(model_path: pathlib.Path) -> list[pathlib.Path]:
    """The files whose bytes are the model's weights (the GGUF file, or the safetensors)."""
    return [model_path] if is_gguf(model_path) else safetensors_files(model_path)


def _hash_files(files: list[pathlib.Path]) -> str:
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode() + b"\0")
        with open(path, "rb") as handle:
            while chunk := handle.read(CHUNK_BYTES):
                digest.update(chunk)
    return digest.hexdigest()


def weights_digest(model_path: pathlib.Path, cache_root: pathlib.Path) -> str:
    """Hex SHA-256 of the model's weight files (memoized under `cache_root/digests`)."""
    files = weight_files(model_path)
    stat_key = json.dumps(
        [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files]
    ).encode()
    memo = cache_root / "digests" / f"{hashlib.sha256(stat_key).hexdigest()}.txt"
    if memo.is_file():
        return memo.read_text().strip()
    value = _hash_files(files)
    memo.parent.mkdir(parents=True, exist_ok=True)
    partial = memo.with_suffix(f".{os.getpid()}.partial")
    partial.write_text(value)
    os.replace(partial, memo)
    return value
