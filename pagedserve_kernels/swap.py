"""Block swap between two pools (device <-> CPU, or CPU <-> CPU), all layers, K and V.

Each direction is one gather on the source side, one transfer and one indexed store on the
destination side, never a copy per pair or per layer:

* device -> CPU: gather on the device, copy into a pinned staging buffer without blocking, wait for
  that copy (the CPU must not read it early), then store into the CPU pool.
* CPU -> device: gather on the CPU straight into a pinned staging buffer, copy it to the device
  without blocking, store on the device. The pinned buffer's lifetime is tracked by torch's caching
  host allocator, so the call returns without waiting for the transfer; later work on the same
  stream is ordered after it.
"""

from __future__ import annotations

import torch


def _pinned_like(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, pin_memory=torch.cuda.is_available())


def swap_blocks(src_pool: torch.Tensor, dst_pool: torch.Tensor, pairs: torch.Tensor) -> None:
    """Copy ``src_pool[:, :, src]`` onto ``dst_pool[:, :, dst]`` for every ``(src, dst)`` pair."""
    if pairs.shape[0] == 0:
        return
    src_ids = pairs[:, 0].to(device=src_pool.device, dtype=torch.int64)
    dst_ids = pairs[:, 1].to(device=dst_pool.device, dtype=torch.int64)
    src_device, dst_device = src_pool.device.type, dst_pool.device.type
    if src_device != "cpu" and dst_device == "cpu":
        gathered = src_pool.index_select(2, src_ids)
        staging = _pinned_like(gathered.shape, gathered.dtype)
        staging.copy_(gathered, non_blocking=True)
        torch.cuda.current_stream(src_pool.device).synchronize()
        dst_pool.index_copy_(2, dst_ids, staging)
    elif src_device == "cpu" and dst_device != "cpu":
        shape = list(src_pool.shape)
        shape[2] = src_ids.shape[0]
        staging = _pinned_like(torch.Size(shape), src_pool.dtype)
        torch.index_select(src_pool, 2, src_ids, out=staging)
        dst_pool.index_copy_(2, dst_ids, staging.to(dst_pool.device, non_blocking=True))
    else:
        dst_pool.index_copy_(2, dst_ids, src_pool.index_select(2, src_ids).to(dst_pool.device))
