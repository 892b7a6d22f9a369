"""The model's tokenizer and chat template, from the same source as the weights (offline).

From a GGUF file, transformers builds the tokenizer out of the GGUF metadata, which takes seconds;
the result is saved under `<weights cache>/<weights digest>/tokenizer` (atomically, by rename)
so later loads of the same file read it back in a fraction of that.

A directory's tokenizer is parsed once per process and shared while its files are unchanged
(their names, sizes and modification times key it): parsing a 49k-token `tokenizer.json` takes
a fifth of a second, and a process may start many engines on one model (tests, notebooks).
Shared means read-only: nothing here or in the engine sets attributes on a tokenizer.
"""

from __future__ import annotations

import functools
import os
import pathlib
import shutil

import transformers

from workers.model_source import is_gguf, resolve_model_path
from workers.weights_digest import default_cache_root, weights_digest


def load_tokenizer(
    model: str, cache_dir: str | None = None
) -> transformers.PreTrainedTokenizerBase:
    """The tokenizer of `model` (see `resolve_model_path`) with its `.chat_template` set.

    `cache_dir` is the weights cache root (default: `~/.cache/pagedserve/weights`).
    """
    path = resolve_model_path(model)
    if not is_gguf(path):
        return _directory_tokenizer(str(path), _files_signature(path))
    root = pathlib.Path(cache_dir) if cache_dir else default_cache_root()
    cached = root / weights_digest(path, root) / "tokenizer"
    if cached.is_dir():
        return _directory_tokenizer(str(cached), _files_signature(cached))
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        str(path.parent), gguf_file=path.name, local_files_only=True
    )
    partial = cached.with_name(f"tokenizer.partial.{os.getpid()}")
    tokenizer.save_pretrained(str(partial))
    try:
        partial.rename(cached)
    except OSError:  # another process saved it first
        shutil.rmtree(partial, ignore_errors=True)
    return tokenizer


def _files_signature(directory: pathlib.Path) -> tuple[tuple[str, int, int], ...]:
    """Each file's name, size and modification time: a changed file is a new key."""
    entries = []
    for entry in sorted(os.scandir(directory), key=lambda e: e.name):
        if entry.is_file():
            stat = entry.stat()
            entries.append((entry.name, stat.st_size, stat.st_mtime_ns))
    return tuple(entries)


@functools.lru_cache(maxsize=8)
def _directory_tokenizer(
    directory: str, signature: tuple[tuple[str, int, int], ...]
) -> transformers.PreTrainedTokenizerBase:
    """The tokenizer saved in `directory`, parsed once per `signature` (see the module doc)."""
    return transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)
