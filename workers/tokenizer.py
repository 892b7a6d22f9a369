"""The model's tokenizer and chat template, from the same source as the weights (offline).

From a GGUF file, transformers builds the tokenizer out of the GGUF metadata, which takes seconds;
the result is saved under `<weights cache>/<weights digest>/tokenizer` (atomically, by rename)
so later loads of the same file read it back in a fraction of that.
"""

from __future__ import annotations

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
        return transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    root = pathlib.Path(cache_dir) if cache_dir else default_cache_root()
    cached = root / weights_digest(path, root) / "tokenizer"
    if cached.is_dir():
        return transformers.AutoTokenizer.from_pretrained(str(cached), local_files_only=True)
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
