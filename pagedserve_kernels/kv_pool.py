"""The KV pool: one tensor holding every layer's K and V blocks (production code, no oracle).

Invariant: ``pool[l, 0]`` / ``pool[l, 1]`` are layer l's K / V caches, and block id b names the
same block in every layer, so copies and swaps over all layers are single indexed operations.
"""

from __future__ import annotations

import torch

from pagedserve_kernels import kv_quant, validation


def allocate_kv_pool(
    *,
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
    pin_memory: bool = False,
) -> torch.Tensor:
    """One zeroed tensor ``[num_layers, 2, num_blocks, block_size, num_kv_heads, width]``:
    ``width`` is ``head_dim``, or ``head_dim`` codes plus the scale's bytes for an int8
    ``dtype`` (``pagedserve_kernels.kv_quant``).

    ``pool[l, 0]`` is layer l's K cache and ``pool[l, 1]`` its V cache. A block id names the same
    block in every layer, so copies and swaps over all layers are single indexed operations.
    ``pin_memory`` pins a CPU pool for asynchronous swaps; it is ignored where CUDA is absent.
    """
    sizes = {
        "num_layers": num_layers,
        "num_blocks": num_blocks,
        "block_size": block_size,
        "num_kv_heads": num_kv_heads,
    }
    for name, size in sizes.items():
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"{name} must be a positive int, got {size!r}")
    if head_dim not in validation.SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"head_dim {head_dim} unsupported; supported: {validation.SUPPORTED_HEAD_DIMS}"
        )
    if dtype not in validation.CACHE_DTYPES:
        raise ValueError(f"dtype {dtype} unsupported; supported: {validation.CACHE_DTYPES}")
    device = torch.device(device)
    pin = pin_memory and device.type == "cpu" and torch.cuda.is_available()
    width = kv_quant.stored_width(head_dim, dtype)
    shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, width)
    return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin)
