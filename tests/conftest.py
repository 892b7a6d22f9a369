"""Shared test configuration: GPU-marked tests are skipped where CUDA is absent; torch runs on
one thread outside the kernel tests; the tiny model and a local Ray cluster are shared fixtures.

Tests marked `ray` start Ray, Ray Serve or a `pagedserve serve` process; those marked `smollm2`
load SmolLM2-135M's weights. A test using one of `RAY_FIXTURES` or `SMOLLM2_FIXTURES` is marked
so by that alone. `--fast` (`make test-fast`) deselects both kinds; under it a test that still
leaves Ray initialized in this process fails, naming the marker it lacks.

Under pytest-xdist (`-n 2 --dist loadgroup`, as `make test` runs) every `ray` test is in the one
`xdist_group` `RAY_GROUP`, so they all run on one worker, one after another: two Ray Serve
instances on one machine kill each other's proxies. The exception is a test marked `plain_ray`
(Ray core only: actors on the shared cluster or on a cluster of its own, no Serve app): those
are in `PLAIN_RAY_GROUP`, which runs on another worker beside the Serve tests with Ray clusters
of that worker's own (plain local clusters do not collide); a `plain_ray` test that leaves Serve
running fails. The other `smollm2` tests are in `SMOLLM2_GROUP`, so SmolLM2's weights and HF
references (session fixtures) are built on one worker only. xdist hands each group to one worker
whole, the two largest (`RAY_GROUP`, then `SMOLLM2_GROUP` or `PLAIN_RAY_GROUP`) first, then the
next to whichever worker is nearly out of work: the `RAY_GROUP` worker only at its group's end,
long after the other has taken `PLAIN_RAY_GROUP` (were it otherwise, the `own_ray` check below
fails the run rather than letting it flake).

The in-process Ray cluster (`ray_cluster`) is one per session: started by the first test that
needs it, kept until the session ends. Tests marked `own_ray` start a Ray cluster of their own
(a `ray.cluster_utils.Cluster`, a `pagedserve serve` process): they are ordered before every
other test, so they run before the shared cluster starts. The tests of the session's one
two-replica Serve app (`two_replica_app`, tests/serving/two_replicas.py) are ordered after
every other test, so no other test runs while a second application is deployed (gRPC without
`application` metadata reaches the only app); those marked `kills_a_replica` come last.

Hypothesis runs its default budget (`tests/hypothesis_profiles.py`; `--hypothesis-profile=
thorough` for a longer search).
"""

from __future__ import annotations

import pathlib
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from tests import hypothesis_profiles

hypothesis_profiles.register()

RAY_FIXTURES = frozenset({"ray_cluster", "served"})
SMOLLM2_FIXTURES = frozenset({"smollm2_hf"})
RAY_GROUP = "ray"
PLAIN_RAY_GROUP = "plain_ray"
SMOLLM2_GROUP = "smollm2"
OWN_RAY_MARK = "own_ray"
TWO_REPLICA_FIXTURE = "two_replica_app"
KILLS_A_REPLICA_MARK = "kills_a_replica"


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--fast",
        action="store_true",
        help="the inner loop: deselect the tests marked `ray` or `smollm2`",
    )


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the `xdist_group` marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if fixtures & RAY_FIXTURES:
            item.add_marker(pytest.mark.ray)
        if fixtures & SMOLLM2_FIXTURES:
            item.add_marker(pytest.mark.smollm2)
        if item.get_closest_marker("ray") is not None:
            plain = item.get_closest_marker("plain_ray") is not None
            item.add_marker(pytest.mark.xdist_group(PLAIN_RAY_GROUP if plain else RAY_GROUP))
        elif item.get_closest_marker("smollm2") is not None:
            item.add_marker(pytest.mark.xdist_group(SMOLLM2_GROUP))
    # stable: within each part the collection order holds (a module's tests stay together)
    items.sort(key=_run_order)
    if config.getoption("fast"):
        slow = [item for item in items if {"ray", "smollm2"} & set(item.keywords)]
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if item not in slow]
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def _run_order(item: pytest.Item) -> tuple[bool, bool, bool]:
    """`own_ray` tests first; the tests of the session's two-replica Serve app last, those that
    kill one of its replicas after the others (each waits for the replacement)."""
    two_replicas = TWO_REPLICA_FIXTURE in getattr(item, "fixturenames", ())
    kills = item.get_closest_marker(KILLS_A_REPLICA_MARK) is not None
    return item.get_closest_marker(OWN_RAY_MARK) is None, two_replicas, kills


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    """Under `--dist loadgroup` xdist schedules by the `@group` suffix it adds to each grouped
    test's node id; a pytest/xdist pair where that suffix is missing would put Ray tests on
    both workers at once, so the run stops instead."""
    if not getattr(session.config.option, "loadgroup", False):
        return
    for item in session.items:
        for mark in item.iter_markers("xdist_group"):
            if not item.nodeid.endswith(f"@{mark.args[0]}"):
                message = (
                    f"pytest-xdist did not group {item.nodeid} ({mark.args[0]!r}): this pytest "
                    "and pytest-xdist pair breaks `--dist loadgroup` (see pyproject's pins)"
                )
                print(message, file=sys.stderr)  # the controller reports only an internal error
                raise pytest.UsageError(message)


def _ray_initialized() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


@pytest.fixture(autouse=True)
def _ray_only_in_ray_tests(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test not marked `ray` that starts Ray fails (and Ray is shut down): `--fast` must leave
    it out, and under xdist it would run beside the `RAY_GROUP` worker's Ray. Under `--fast`
    any test that leaves Ray initialized fails."""
    initialized_before = _ray_initialized()
    yield
    if request.node.get_closest_marker("ray") is not None or not _ray_initialized():
        return
    if request.config.getoption("fast") or not initialized_before:
        sys.modules["ray"].shutdown()
        pytest.fail("this test starts Ray: mark it `pytest.mark.ray` (kept out of --fast)")


def _serve_running() -> bool:
    if "ray.serve" not in sys.modules or not _ray_initialized():
        return False
    import ray

    try:
        ray.get_actor("SERVE_CONTROLLER_ACTOR", namespace="serve")
    except ValueError:
        return False
    return True


@pytest.fixture(autouse=True)
def _plain_ray_runs_no_serve(request: pytest.FixtureRequest) -> Iterator[None]:
    """A `plain_ray` test may run beside another worker's Serve app only because it starts no
    Serve app itself: one that leaves Serve running where it was not fails."""
    plain = request.node.get_closest_marker("plain_ray") is not None
    serve_before = plain and _serve_running()
    yield
    if plain and not serve_before and _serve_running():
        pytest.fail("this `plain_ray` test left Ray Serve running: drop the mark (`ray` alone)")


@pytest.fixture(autouse=True)
def _own_ray_before_the_shared_cluster(request: pytest.FixtureRequest) -> None:
    """A test that starts its own Ray cluster fails at once if this process's shared one runs:
    the ordering of `pytest_collection_modifyitems` was broken."""
    if request.node.get_closest_marker(OWN_RAY_MARK) is not None and _ray_initialized():
        pytest.fail(f"a `{OWN_RAY_MARK}` test ran after the shared Ray cluster started")


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread(request: pytest.FixtureRequest) -> Iterator[None]:
    """Run torch ops on one intra-op thread: on a small shared machine, intra-op threads that
    spin while other processes hold the cores make every step many times slower (HF's tiny-model
    greedy decoding 18x). The kernel tests keep the process's count: their multi-thread paths
    are under test, and they set the counts they compare themselves."""
    import torch

    if request.module.__name__.startswith("tests.kernels."):
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """An HF directory holding the seeded tiny random Llama of `tests/tiny_model.py`."""
    from tests.tiny_model import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def tiny_hf(tiny_model_dir: pathlib.Path) -> Any:
    """HF transformers' float32 model of the tiny Llama, loaded once per session: the oracle of
    the tiny-model tests. Shared, so a test only reads it (no adapters, no weight changes)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def tiny_thinker_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """An HF directory holding a seeded tiny random Qwen3 whose tokenizer has `<think>` and
    `</think>` tokens and whose chat template takes `enable_thinking` (`tests/tiny_model.py`)."""
    from tests.tiny_model import make_tiny_qwen3_thinker

    return make_tiny_qwen3_thinker(tmp_path_factory.mktemp("tiny_thinker"))


@pytest.fixture(scope="session")
def smollm2_hf() -> Any:
    """HF transformers' float32 SmolLM2-135M-Instruct from the default model's GGUF file: the
    oracle of every SmolLM2 parity test (loaded once per session, by HF's own GGUF loader with its
    header parsed once: `tests.hf_gguf`)."""
    from tests.hf_gguf import hf_model_from_gguf
    from workers import resolve_model_path

    return hf_model_from_gguf(resolve_model_path("default"))


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    """The session's local 2-CPU Ray cluster (tests/serving's `served` app runs on it too):
    started once, shut down when the session ends. Each test leaves it as it found it (its
    actors and placement groups gone, its CPUs free)."""
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()
