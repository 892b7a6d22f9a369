"""Paged KV-cache bookkeeping: physical pools, block tables, exact cache identity, sharing.

Pure Python: imports no torch, no ray and nothing else of pagedserve. It emits plans (block ids,
copy and swap pairs) that the workers execute. `KVCacheManager` satisfies the `KVManager`
protocol the scheduler codes against; the research baselines beside it live in `kv_layouts`.
"""

from block_manager.cache_key import CacheKey
from block_manager.errors import (
    AllocationFailure,
    BlockManagerError,
    IntegrityError,
    InvalidOperation,
    NeverFits,
    NoFreeBlocks,
)
from block_manager.events import BlockEvent
from block_manager.identity import CacheIdentity, block_hash
from block_manager.manager import KVCacheManager
from block_manager.pressure import PressureSnapshot, TierPressure
from block_manager.prompt_blocks import cacheable_blocks, prompt_block_hashes
from block_manager.protocol import KVManager, TableDelta
from block_manager.tiers import TierCounters, TierTransfers
from block_manager.types import BlockCopy, SeqId
from block_manager.usage import LayoutAccounting, LayoutUsage

__all__ = [
    "AllocationFailure",
    "BlockCopy",
    "BlockEvent",
    "BlockManagerError",
    "CacheIdentity",
    "CacheKey",
    "IntegrityError",
    "InvalidOperation",
    "KVCacheManager",
    "KVManager",
    "LayoutAccounting",
    "LayoutUsage",
    "NeverFits",
    "NoFreeBlocks",
    "PressureSnapshot",
    "SeqId",
    "TableDelta",
    "TierCounters",
    "TierPressure",
    "TierTransfers",
    "block_hash",
    "cacheable_blocks",
    "prompt_block_hashes",
]
