"""Fixtures of the KV layout tests: SmolLM2's tokenizer, and engines over `SlotWorkers`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from cluster.engine.config import EngineConfig
from cluster.engine.engine_core import EngineCore
from kv_layouts.virtual import VirtualKVManager
from tests.engine.slot_workers import SlotWorkers


@pytest.fixture(scope="session")
def smollm2_tokenizer() -> Any:
    from workers import load_tokenizer

    return load_tokenizer("default")


SlotLayoutEngine = Callable[..., EngineCore]


@pytest.fixture
def slot_layout_engine(smollm2_tokenizer: Any) -> SlotLayoutEngine:
    """`slot_layout_engine(layout, num_device_blocks=..., max_num_seqs=...)`: an EngineCore under
    `layout` over SlotWorkers (integrity checked every step). For `virtual` the slot pool is the
    virtual range of every slot, while the engine's budget stays `num_device_blocks`."""

    def build(
        layout: str, *, num_device_blocks: int, max_num_seqs: int = 8, max_model_len: int = 128
    ) -> EngineCore:
        block_size = 4
        config = EngineConfig().with_overrides(
            {
                "cache": {"block_size": block_size, "watermark": 0.0, "kv_layout": layout},
                "scheduler": {
                    "check_integrity": True,
                    "max_num_seqs": max_num_seqs,
                    "preemption_mode": "recompute",
                },
                "parallel": {"backend": "local"},
            }
        )
        pool_blocks = num_device_blocks
        if layout == "virtual":
            pool_blocks = max_num_seqs * -(-max_model_len // block_size) * 2  # generous
        workers = SlotWorkers(
            num_device_blocks=pool_blocks,
            num_cpu_blocks=0,
            block_size=block_size,
            max_model_len=max_model_len,
        )
        workers.num_device_blocks = num_device_blocks  # the engine's budget
        engine = EngineCore(config, workers, tokenizer=smollm2_tokenizer)  # type: ignore[arg-type]
        manager = engine.block_manager
        if layout == "virtual":
            assert isinstance(manager, VirtualKVManager)
            assert manager.num_virtual_blocks <= pool_blocks
        return engine

    return build
