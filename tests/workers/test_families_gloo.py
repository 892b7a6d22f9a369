"""Every family's TP=2 shards (and the MoE families' expert-parallel shards) in two processes
joined by gloo directly, without Ray: the logits of every prompt position against HF's.

The same sharding the Ray workers run (`load_model_shard` on `TensorParallel(rank, 2)`), one
prefill over a paged pool (`gloo_shards`). The two processes start once for the module
and run every case in turn. Tolerance: 1e-4 absolute.
"""

from __future__ import annotations

import multiprocessing
import pathlib

import pytest
import torch
import torch.multiprocessing as mp
import transformers

from benchmarks.ports import free_port
from tests.workers.gloo_shards import PROMPT, run_rank
from tests.workers.tiny_families import FAMILY_CASES, FAMILY_MODELS, write_family_model

Case = tuple[str, bool]


@pytest.fixture(scope="module")
def gloo_outputs(
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[Case, tuple[pathlib.Path, transformers.PreTrainedModel]]:
    """Per case: the file rank 0 saved its logits to, and the HF model with the same weights."""
    root = tmp_path_factory.mktemp("gloo_families")
    references = {name: write_family_model(name, root / name) for name in FAMILY_MODELS}
    outputs = {case: root / f"{case[0]}-ep{int(case[1])}.pt" for case in FAMILY_CASES}
    cases = [(str(root / name), ep, str(outputs[name, ep])) for name, ep in FAMILY_CASES]
    # Both ranks fork from one forkserver that imported the rank's module once.
    multiprocessing.get_context("forkserver").set_forkserver_preload([run_rank.__module__])
    mp.start_processes(
        run_rank,
        args=(cases, str(root / "cache"), free_port()),
        nprocs=2,
        start_method="forkserver",
    )
    return {case: (outputs[case], references[case[0]]) for case in FAMILY_CASES}


@pytest.mark.parametrize(("name", "expert_parallel"), FAMILY_CASES)
def test_two_gloo_ranks_match_hf(
    name: str,
    expert_parallel: bool,
    gloo_outputs: dict[Case, tuple[pathlib.Path, transformers.PreTrainedModel]],
) -> None:
    out, reference = gloo_outputs[name, expert_parallel]
    with torch.no_grad():
        expected = reference(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(torch.load(out), expected, atol=1e-4, rtol=0)
