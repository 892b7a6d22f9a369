"""How many KV blocks a rank can hold: explicit counts, byte budgets, or CUDA profiling.

Budgets are per rank: `kv_cache_bytes` and `swap_space_bytes` are what each rank may spend on its
own shard (its KV heads), so the count is budget // (bytes of one block of this rank's shard).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve_kernels import kv_quant
from workers.config import WorkerConfig

DEFAULT_CPU_KV_BYTES = 512 * 2**20
"""Per-rank KV budget on CPU when neither `num_device_blocks` nor `kv_cache_bytes` is given."""


@dataclass(frozen=True)
class KVShape:
    """One rank's KV pool geometry (all layers, K and V, this rank's KV heads); `dtype` is the
    pool's (`pagedserve_kernels.kv_quant.storage_dtype`), so an int8 pool's bytes count the
    scales stored beside the codes."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        element = kv_quant.element_bytes(self.dtype)
        width = kv_quant.stored_width(self.head_dim, self.dtype)
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * width * element


def blocks_from_budget(budget_bytes: int, shape: KVShape, what: str) -> int:
    blocks = budget_bytes // shape.bytes_per_block
    if blocks <= 0:
        raise ValueError(
            f"{what} of {budget_bytes} bytes holds no KV block "
            f"(one block is {shape.bytes_per_block} bytes per rank)"
        )
    return blocks


def cpu_device_blocks(config: WorkerConfig, shape: KVShape) -> int:
    """Device blocks on a CPU rank: the explicit count, else the byte budget."""
    if config.num_device_blocks is not None:
        return config.num_device_blocks
    budget = config.kv_cache_bytes if config.kv_cache_bytes is not None else DEFAULT_CPU_KV_BYTES
    return blocks_from_budget(budget, shape, "kv_cache_bytes")


def cuda_device_blocks(config: WorkerConfig, shape: KVShape, device: torch.device) -> int:
    """Device blocks on a CUDA rank after a profiling forward pass has set the peak memory.

    Blocks fill `gpu_memory_utilization` of the device, minus this process's peak reserved
    memory (weights and activations) and what other processes already use.
    """
    if config.num_device_blocks is not None:
        return config.num_device_blocks
    if config.kv_cache_bytes is not None:
        return blocks_from_budget(config.kv_cache_bytes, shape, "kv_cache_bytes")
    free, total = torch.cuda.mem_get_info(device)
    reserved_now = torch.cuda.memory_reserved(device)
    others = total - free - reserved_now
    budget = int(total * config.gpu_memory_utilization) - torch.cuda.max_memory_reserved(device)
    return blocks_from_budget(budget - others, shape, "GPU memory left for the KV cache")


def cpu_swap_blocks(config: WorkerConfig, shape: KVShape) -> int:
    """Blocks of the CPU swap tier: the explicit count, else `swap_space_bytes` (0 allowed)."""
    if config.num_cpu_blocks is not None:
        return config.num_cpu_blocks
    return config.swap_space_bytes // shape.bytes_per_block
