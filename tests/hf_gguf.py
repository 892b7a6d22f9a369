"""HF transformers' own GGUF loading, with what it computes twice computed once.

`from_pretrained(..., gguf_file=...)` parses the file's header twice (once for the config, once
for the weights), each time decoding the whole vocabulary token by token, and builds the same
GGUF-to-HF tensor name map once per module of the model (hundreds of times). Both are pure
functions of their arguments: here the same `gguf.GGUFReader` serves both reads of a file and
`gguf.get_tensor_name_map` answers each (architecture, layers) once. Every tensor HF loads is
still HF's own conversion of the file (the oracle stays independent of our loader).
"""

from __future__ import annotations

import contextlib
import functools
import pathlib
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch
import transformers


@contextlib.contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """Meanwhile, HF's GGUF reads share one reader per file and one name map per model shape."""
    import gguf

    reader = functools.cache(gguf.GGUFReader)
    name_map = functools.cache(gguf.get_tensor_name_map)
    with (
        mock.patch.object(gguf, "GGUFReader", reader),
        mock.patch.object(gguf, "get_tensor_name_map", name_map),
    ):
        yield


def hf_model_from_gguf(path: pathlib.Path | str, **kwargs: Any) -> transformers.PreTrainedModel:
    """HF's float32 model of the GGUF file at `path` (in eval mode), loaded by HF itself."""
    path = pathlib.Path(path)
    with gguf_parsed_once():
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32, **kwargs
        )
    return model.eval()
