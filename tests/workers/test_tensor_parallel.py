"""TP=2 on CPU (two Ray actors joined by gloo) against TP=1 on the tiny model.

Tolerance: logits within 1e-4 absolute (the all-reduces sum partial products in another order);
greedy tokens identical.
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import time
from collections.abc import Iterator

import pytest
import ray
import torch

from tests.workers.paged_runner import greedy_generate
from workers import SamplingSettings, SequenceWork, StepPlan, WorkerConfig, WorkerGroup
from workers.config import ModelSpec, RopeSpec
from workers.parallel import HeadLayout, TensorParallel, check_tensor_parallel, head_layout

# The Ray tests here run Ray core actors only (no Serve): beside the Serve tests under xdist.
pytestmark = pytest.mark.plain_ray

LOGITS_ATOL = 1e-4


@pytest.fixture(scope="module")
def tp2_group(
    ray_cluster: None, tiny_model_dir: pathlib.Path, weights_cache: pathlib.Path
) -> Iterator[WorkerGroup]:
    group = WorkerGroup(
        WorkerConfig(
            dtype="float32",
            model=str(tiny_model_dir),
            backend="ray",
            tensor_parallel_size=2,
            block_size=4,
            num_device_blocks=96,
            num_cpu_blocks=16,
            weights_cache_dir=str(weights_cache),
        )
    )
    yield group
    group.shutdown()


def test_failed_start_names_the_problem_and_frees_the_cluster(
    ray_cluster: None, tiny_model_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    # Runs before `tp2_group` exists (file order), so the cluster's two CPUs are free.
    model = tmp_path / "mismatch"
    model.mkdir()
    for path in tiny_model_dir.iterdir():
        if path.name != "config.json":
            (model / path.name).symlink_to(path)
    config = json.loads((tiny_model_dir / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "intermediate_size": 128}))
    settings = WorkerConfig(
        dtype="float32",
        model=str(model),
        tensor_parallel_size=2,
        num_device_blocks=8,
        weights_cache_dir=str(tmp_path),
    )
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.gate_proj\.weight' has shape"):
        WorkerGroup(settings)
    deadline = time.monotonic() + 30
    while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0) == 2


def test_tp2_matches_tp1(tp2_group: WorkerGroup, tiny_group: WorkerGroup) -> None:
    prompts = [[5, 17, 99, 1000, 48000, 3], list(range(200, 213)), [42]]
    tp1 = greedy_generate(tiny_group, prompts, 8, seed=5, prefill_chunk=4)
    tp2 = greedy_generate(tp2_group, prompts, 8, seed=9, prefill_chunk=4)
    assert tp2.tokens == tp1.tokens
    for logits_tp2, logits_tp1 in zip(tp2.logits, tp1.logits, strict=True):
        torch.testing.assert_close(logits_tp2, logits_tp1, atol=LOGITS_ATOL, rtol=0)
    assert tp2_group.num_device_blocks == 96
    assert tp2_group.model_info == tiny_group.model_info
    assert tp2_group.overhead.steps > 0 and tp2_group.overhead.mean >= 0.0


def _spec(heads: int, kv_heads: int) -> ModelSpec:
    return ModelSpec(
        architecture="llama",
        vocab_size=10,
        hidden_size=heads * 32,
        intermediate_size=64,
        num_layers=1,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=32,
        rms_norm_eps=1e-5,
        max_position_embeddings=64,
        rope=RopeSpec(),
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=True,
        layer_sliding_windows=(None,),
        bos_token_id=None,
        eos_token_ids=(),
    )


def test_head_layout_splits_and_replicates_kv_heads() -> None:
    spec = _spec(heads=8, kv_heads=2)
    split = [head_layout(spec, TensorParallel(r, 2)) for r in range(2)]
    assert split == [HeadLayout(0, 4, 0, 1), HeadLayout(4, 4, 1, 1)]
    replicated = [head_layout(spec, TensorParallel(r, 4)) for r in range(4)]
    assert [(layout.q_start, layout.kv_start, layout.num_kv) for layout in replicated] == [
        (0, 0, 1),
        (2, 0, 1),
        (4, 1, 1),
        (6, 1, 1),
    ]
    with pytest.raises(ValueError, match="does not divide the model's 8 attention heads"):
        check_tensor_parallel(spec, 3)


def test_execute_async_returns_what_execute_returns(
    tp2_group: WorkerGroup, tiny_group: WorkerGroup
) -> None:
    settings = SamplingSettings(temperature=0.8, seed=5, logprobs=2)
    work = SequenceWork(60, [3, 1, 4, 1, 5, 9, 2, 6], 0, 0, [8, 9], 2, 0, 0, settings)
    remote = asyncio.run(tp2_group.execute_async(StepPlan(400, [work])))
    local = asyncio.run(tiny_group.execute_async(StepPlan(400, [work])))
    assert [t.token_id for t in remote.samples[60]] == [t.token_id for t in local.samples[60]]
    for a, b in zip(remote.samples[60], local.samples[60], strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
    tp2_group.execute(StepPlan(401, released=[60]))
    tiny_group.execute(StepPlan(401, released=[60]))
