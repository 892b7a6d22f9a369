"""Every family beyond Llama's at TP=2 on CPU (two Ray actors joined by gloo) against HF;
the mixture-of-experts ones also with expert parallelism (whole experts per rank).

Tolerance: logits within 1e-4 absolute (the all-reduces sum partial products in another
order); greedy tokens identical.
"""

from __future__ import annotations

import pathlib

import pytest

from tests.workers.family_parity import assert_greedy_matches_hf, family_group
from tests.workers.tiny_families import FAMILY_CASES, write_family_model

# The Ray tests here run Ray core actors only (no Serve): beside the Serve tests under xdist.
pytestmark = pytest.mark.plain_ray

PROMPTS = [list(range(3, 20)), [42, 7, 300]]
NEW_TOKENS = 6


@pytest.mark.parametrize(("name", "expert_parallel"), FAMILY_CASES)
def test_family_tp2_matches_hf(
    ray_cluster: None, name: str, expert_parallel: bool, tmp_path: pathlib.Path
) -> None:
    reference = write_family_model(name, tmp_path / name)
    with family_group(
        tmp_path / name,
        tmp_path / "cache",
        num_device_blocks=96,
        backend="ray",
        tensor_parallel_size=2,
        enable_expert_parallel=expert_parallel,
    ) as group:
        assert_greedy_matches_hf(group, reference, PROMPTS, NEW_TOKENS, seed=3, prefill_chunk=6)
