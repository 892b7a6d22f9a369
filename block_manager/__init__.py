"""Paged KV-cache bookkeeping: physical pools, block tables, exact cache identity, sharing.

Pure Python: imports no torch, no ray and nothing else of pagedserve. It emits plans (block ids,
copy and swap pairs) that the workers execute.
"""

from block_manager.errors import (
    AllocationFailure,
    BlockManagerError,
    IntegrityError,
    InvalidOperation,
    NeverFits,
    NoFreeBlocks,
)
from block_manager.identity import CacheIdentity, block_hash
from block_manager.manager import KVCacheManager
from block_manager.pressure import PressureSnapshot, TierPressure
from block_manager.types import BlockCopy, SeqId

__all__ = [
    "AllocationFailure",
    "BlockCopy",
    "BlockManagerError",
    "CacheIdentity",
    "IntegrityError",
    "InvalidOperation",
    "KVCacheManager",
    "NeverFits",
    "NoFreeBlocks",
    "PressureSnapshot",
    "SeqId",
    "TierPressure",
    "block_hash",
]
