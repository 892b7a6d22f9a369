"""Fixtures of the engine tests: SmolLM2's tokenizer (built once) and engines over `SlotWorkers`."""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from typing import Any

import pytest

from cluster.engine.config import EngineConfig
from cluster.engine.engine_core import EngineCore
from cluster.engine.llm import LLM
from cluster.engine.outputs import RequestOutput
from cluster.engine.queue_wait import QueueWait
from tests.engine.slot_workers import SlotWorkers
from tests.engine.tiny_engine import GREEDY, PROMPTS, assert_all_free, tiny_config


@pytest.fixture(scope="session")
def smollm2_tokenizer() -> Any:
    from workers import load_tokenizer

    return load_tokenizer("default")


SlotEngineFactory = Callable[..., EngineCore]


@pytest.fixture
def slot_engine(smollm2_tokenizer: Any) -> SlotEngineFactory:
    """`slot_engine(num_device_blocks=..., num_cpu_blocks=..., **section_overrides)`: an
    EngineCore over SlotWorkers with integrity checks on every step (`queue_wait`: the
    departure clock its admission predicts from)."""

    def build(
        *,
        num_device_blocks: int = 64,
        num_cpu_blocks: int = 64,
        block_size: int = 4,
        max_model_len: int = 256,
        queue_wait: QueueWait | None = None,
        **overrides: dict[str, Any],
    ) -> EngineCore:
        sections: dict[str, dict[str, Any]] = {
            "cache": {"block_size": block_size, "watermark": 0.0},
            "scheduler": {"check_integrity": True, "max_num_seqs": 16},
            "parallel": {"backend": "local"},
        }
        for section, values in overrides.items():
            sections.setdefault(section, {}).update(values)
        config = EngineConfig().with_overrides(sections)
        workers = SlotWorkers(
            num_device_blocks=num_device_blocks,
            num_cpu_blocks=num_cpu_blocks,
            block_size=block_size,
            max_model_len=max_model_len,
        )
        return EngineCore(
            config,
            workers,  # type: ignore[arg-type]
            tokenizer=smollm2_tokenizer,
            queue_wait=queue_wait,
        )

    return build


@pytest.fixture(scope="session")
def roomy_outputs(tiny_model_dir: pathlib.Path) -> list[RequestOutput]:
    """The tiny Llama's greedy outputs for `PROMPTS` with a roomy pool: the baseline every
    memory regime (and TP=2) must reproduce exactly."""
    with LLM(config=tiny_config(tiny_model_dir)) as llm:
        outputs = llm.generate(PROMPTS, GREEDY)
        assert llm.metrics().preemptions == 0
        assert_all_free(llm)
    return outputs
