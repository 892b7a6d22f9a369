"""The tiny Llama under each KV layout: the same greedy tokens as paged, and the virtual layout's
memory really committed as tokens arrive and returned when sequences end."""

from __future__ import annotations

import pathlib

import pytest

from benchmarks.layout_recorder import LayoutRecorder
from cluster.engine.config import EngineConfig
from cluster.engine.engine_core import EngineCore
from cluster.engine.errors import ConfigError
from cluster.engine.llm import LLM
from cluster.engine.outputs import RequestOutput
from tests.engine.tiny_engine import GREEDY, PROMPTS, greedy_ids, tiny_config


def _layout_config(model_dir: pathlib.Path, layout: str) -> EngineConfig:
    return tiny_config(
        model_dir,
        cache={"kv_layout": layout, "num_cpu_blocks": None, "swap_space_bytes": 0},
        scheduler={"preemption_mode": "recompute"},
    )


@pytest.fixture(scope="module")
def paged_ids(tiny_model_dir: pathlib.Path) -> list[list[int]]:
    with LLM(config=_layout_config(tiny_model_dir, "paged")) as llm:
        return greedy_ids(llm.generate(PROMPTS, GREEDY))


def recorded_generate(engine: EngineCore, recorder: LayoutRecorder) -> list[RequestOutput]:
    """`LLM.generate(PROMPTS, GREEDY)` with every step run by the layouts' recorder."""
    ids = [
        engine.add_request(engine.request_builder.build(prompt, GREEDY)).request_id
        for prompt in PROMPTS
    ]
    finals: dict[str, RequestOutput] = {}
    while engine.has_work():
        for output in recorder.step(engine):
            assert output.error is None, output.error
            if output.finished:
                finals[output.request_id] = output
    return [finals[i] for i in ids]


def test_contiguous_matches_paged(tiny_model_dir: pathlib.Path, paged_ids: list[list[int]]) -> None:
    with LLM(config=_layout_config(tiny_model_dir, "contiguous")) as llm:
        usage = LayoutRecorder.of(llm.engine)
        assert greedy_ids(recorded_generate(llm.engine, usage)) == paged_ids
        assert llm.engine.block_manager.pressure().device.used == 0
        assert usage.sum_reserved_bytes > usage.sum_live_bytes > 0


def test_virtual_matches_paged_and_returns_its_pages(
    tiny_model_dir: pathlib.Path, paged_ids: list[list[int]]
) -> None:
    with LLM(config=_layout_config(tiny_model_dir, "virtual")) as llm:
        engine = llm.engine
        recorder = LayoutRecorder.of(engine, keep_samples=True)
        assert greedy_ids(recorded_generate(engine, recorder)) == paged_ids
        measured = [b for _, b in recorder.measured_backed_bytes]  # the rank pool's mincore
        manager = engine.block_manager
        reserved_bytes = manager.num_virtual_blocks * engine.model_info.kv_bytes_per_block
        # what was committed follows what the manager planned (whole pages per plane) ...
        assert 0 < max(measured) <= recorder.peak_backed_bytes
        # ... is a small part of the reserved virtual range, and all of it came back at the end
        assert max(measured) < reserved_bytes // 20
        assert measured[-1] == 0
        assert recorder.decommit_ranges == len(PROMPTS)
        assert recorder.page_faults > 0
        assert manager.pressure().device.used == 0


def test_layout_settings_are_validated(tiny_model_dir: pathlib.Path) -> None:
    with pytest.raises(ConfigError, match="no CPU swap tier"):
        tiny_config(
            tiny_model_dir, cache={"kv_layout": "contiguous"}, scheduler={"preemption_mode": "swap"}
        )
    with pytest.raises(ConfigError, match="tensor_parallel_size must be 1"):
        tiny_config(
            tiny_model_dir,
            cache={"kv_layout": "virtual"},
            parallel={"backend": "ray", "tensor_parallel_size": 2},
        )
    with pytest.raises(ConfigError, match="kv_layout"):
        tiny_config(tiny_model_dir, cache={"kv_layout": "segmented"})
