"""Fixtures of the journeys and the doc examples: the one `pagedserve serve` process they all
drive (started on first use, stopped by the last journey with SIGTERM), PEFT adapters built for
SmolLM2, the files the docs' examples name, and the in-process engines the examples share."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest

from tests.journeys.run_examples import KeptEngines
from tests.journeys.user_server import UserServer

ADAPTERS = ("sql", "chat", "fr")
"""The adapter names docs/lora.md's examples use; `sql` is served from the start, the others
are loaded at run time."""
DOC_FILES = {
    "engine.yaml": "scheduler: {max_num_seqs: 4}\n",
    "my_serve.yaml": None,  # the shipped Serve config, copied
}
"""Files the examples name that a user would have written (relative to the examples' cwd)."""


def build_smollm2_adapters(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """PEFT adapters of SmolLM2-135M (rank 8 on q/v, B drawn at random so each changes the
    output; `tests/lora/adapters.py`), built on SmolLM2's config with uninitialized base
    weights: an adapter's files depend only on the base model's shapes."""
    import transformers
    from transformers.initialization import no_init_weights

    from tests.lora.adapters import build_adapter
    from workers import resolve_model_path

    gguf = resolve_model_path("default")
    config = transformers.AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    with no_init_weights():
        base = transformers.AutoModelForCausalLM.from_config(config)
    paths = {}
    for seed, name in enumerate(ADAPTERS, start=31):
        model = build_adapter(
            base, root / name, rank=8, targets=("q_proj", "v_proj"), seed=seed, std=0.15
        )
        base = model.unload()
        paths[name] = root / name
    return paths


@pytest.fixture(scope="session")
def adapters_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    root = tmp_path_factory.mktemp("adapters")
    build_smollm2_adapters(root)
    return root


@pytest.fixture(scope="session")
def examples_workdir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The current directory of the doc examples: the files of `DOC_FILES` (a test whose
    examples name adapters links `adapters/` in)."""
    from cluster.serving.cli_serve import shipped_serve_config

    workdir = tmp_path_factory.mktemp("doc_examples")
    for name, text in DOC_FILES.items():
        (workdir / name).write_text(
            text if text is not None else shipped_serve_config().read_text()
        )
    return workdir


@pytest.fixture(scope="session")
def kept_engines() -> Iterator[KeptEngines]:
    engines = KeptEngines()
    yield engines
    engines.close()


@pytest.fixture(scope="session")
def user_server(
    tmp_path_factory: pytest.TempPathFactory, adapters_dir: pathlib.Path
) -> Iterator[UserServer]:
    """`pagedserve serve` as `make serve` runs it, plus its ports and the LoRA flags: launched,
    not yet ready (`live_server` waits for it)."""
    server = UserServer(
        tmp_path_factory.mktemp("user_server"),
        extra_args=[
            "--lora-modules",
            f"sql={adapters_dir / 'sql'}",
            "--allow-runtime-lora-updating",
        ],
    )
    server.launch()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
def live_server(user_server: UserServer) -> UserServer:
    """The shared server once it serves, for a test that needs it still up."""
    if user_server.stopped:
        pytest.fail("the shared server was already stopped: the stop journey must run last")
    user_server.wait_ready()
    return user_server
