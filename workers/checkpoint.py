"""Reading slices of named weights from safetensors files, so each rank reads only its shard.

Both model sources end up here: an HF directory's `*.safetensors` directly, a GGUF file through its
dequantized cache (see `gguf_weights`). Reads validate the full tensor shape against what the model
expects and raise a ValueError naming the tensor when they differ or the tensor is missing.
"""

from __future__ import annotations

import pathlib
from contextlib import ExitStack
from types import TracebackType
from typing import Protocol

import torch
from safetensors import SafetensorError, safe_open

from pagedserve_kernels.gguf_panels import BlockForm


class BlockSource(Protocol):
    """Where a checkpoint's weights were quantized (a GGUF file), their stored block codes."""

    def form(self, name: str, dim: int, start: int, stop: int | None) -> BlockForm | None: ...


class CheckpointReader:
    """Name -> tensor slices over one or more safetensors files (memory-mapped, read lazily)."""

    def __init__(self, files: list[pathlib.Path], blocks: BlockSource | None = None) -> None:
        if not files:
            raise ValueError("no *.safetensors weights files found")
        self._blocks = blocks
        self._stack = ExitStack()
        self._handles: dict[str, object] = {}
        self._files = files
        for path in files:
            try:
                handle = self._stack.enter_context(safe_open(str(path), framework="pt"))
            except (SafetensorError, OSError) as error:
                self._stack.close()
                raise ValueError(f"weights file {path} is truncated or corrupt: {error}") from error
            for name in handle.keys():  # noqa: SIM118  (safe_open is not a mapping)
                self._handles[name] = handle

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        self._stack.close()

    def names(self) -> set[str]:
        return set(self._handles)

    def __contains__(self, name: str) -> bool:
        return name in self._handles

    def read(
        self,
        name: str,
        expected_shape: tuple[int, ...],
        dim: int = 0,
        start: int = 0,
        stop: int | None = None,
    ) -> torch.Tensor:
        """Rows (`dim=0`) or columns (`dim=1`) `[start, stop)` of tensor `name`, as float32.

        Raises ValueError naming the tensor when it is missing or its full shape is not
        `expected_shape` (a config/weights mismatch).
        """
        handle = self._handles.get(name)
        if handle is None:
            raise ValueError(f"weight {name!r} is missing from {[str(f) for f in self._files]}")
        sliced = handle.get_slice(name)  # type: ignore[attr-defined]
        shape = tuple(sliced.get_shape())
        if shape != tuple(expected_shape):
            raise ValueError(
                f"weight {name!r} has shape {list(shape)} but the model config expects "
                f"{list(expected_shape)}"
            )
        stop = shape[dim] if stop is None else stop
        if len(shape) == 1:
            tensor = sliced[start:stop]
        elif dim == 0:
            tensor = sliced[start:stop, :]
        else:
            tensor = sliced[:, start:stop]
        return tensor.to(torch.float32)

    def block_form(
        self, name: str, dim: int = 0, start: int = 0, stop: int | None = None
    ) -> BlockForm | None:
        """The slice `read` returns for the same arguments as the block codes it was
        dequantized from (GGUF files), or None where the reader has none for it."""
        return None if self._blocks is None else self._blocks.form(name, dim, start, stop)


def safetensors_files(directory: pathlib.Path) -> list[pathlib.Path]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model directory {str(directory)!r} has no *.safetensors weights file")
    return files
