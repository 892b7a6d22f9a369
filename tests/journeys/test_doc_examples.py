"""Every example of README.md and docs/*.md runs against the shipped model, so a changed API
breaks a test here, not a reader's paste.

One test per doc runs its `python` and `bash` blocks in order (`tests/journeys/run_examples.py`);
a doc whose examples talk to a server uses the journeys' one `pagedserve serve` process (the
examples' `localhost:8000` and `:9000` pointed at its ports). A block the suite cannot run is
marked `<!-- not-run: why -->` in the doc, and `NOT_RUN` below lists every such block: a marker
added or removed without updating the list fails, so no example is skipped silently.
"""

from __future__ import annotations

import pathlib

import pytest

from tests.journeys.doc_examples import RUNNABLE_LANGUAGES, SHOWN_LANGUAGES, all_blocks
from tests.journeys.run_examples import DocRunner, KeptEngines, ServerPorts
from tests.journeys.user_server import UserServer

NOT_RUN = {
    ("README.md", "make serve"): "starts a server in the foreground, and runs this suite",
    ("docs/serving.md", ".venv/bin/serve run"): "starts a server in the foreground",
    ("docs/serving.md", "docker build"): "Docker, an image registry, Kubernetes with KubeRay",
    ("docs/serving.md", "lm_eval --model"): "lm-eval is not a dependency; a task takes hours",
}
"""(doc, the block's first words) of every block marked not-run."""
SERVER_MARKS = [pytest.mark.ray, pytest.mark.own_ray]
OFFLINE_MARKS = [pytest.mark.smollm2]


def _examples_by_doc() -> dict[str, list]:
    by_doc: dict[str, list] = {}
    for block in all_blocks():
        if block.is_example and block.not_run is None:
            by_doc.setdefault(block.doc, []).append(block)
    return by_doc


EXAMPLES = _examples_by_doc()


def _marks(blocks: list) -> list:
    """A doc's test needs the server if one of its examples does; it loads SmolLM2 if any
    example is code (a yaml block only builds an application: no weights read)."""
    if any(b.needs_server for b in blocks):
        return SERVER_MARKS
    return OFFLINE_MARKS if any(b.language != "yaml" for b in blocks) else []


def _doc_params() -> list:
    return [
        pytest.param(
            doc,
            id=doc,
            marks=_marks(blocks),
        )
        for doc, blocks in EXAMPLES.items()
    ]


def test_every_block_not_run_is_listed_with_its_reason() -> None:
    marked = {
        (block.doc, " ".join(block.code.split()[:2])): block.not_run
        for block in all_blocks()
        if block.not_run is not None
    }
    assert marked == NOT_RUN
    marked_elsewhere = [b.where for b in all_blocks() if b.not_run and not b.is_example]
    assert marked_elsewhere == [], "not-run markers belong on examples only"


def test_every_block_is_an_example_or_shown() -> None:
    unknown = [
        f"{b.where} ({b.language})"
        for b in all_blocks()
        if b.language not in RUNNABLE_LANGUAGES | SHOWN_LANGUAGES
    ]
    assert unknown == [], "tag examples python, bash or yaml; output text or json"


def test_the_docs_have_examples_of_every_kind() -> None:
    """The extraction itself: README's three API examples and the serving docs' curls found."""
    readme = [b.language for b in EXAMPLES["README.md"]]
    assert readme == ["python", "python", "python"]
    assert any("curl" in b.code for b in EXAMPLES["docs/serving.md"])
    assert any(b.language == "yaml" for b in EXAMPLES["docs/pd.md"])


@pytest.mark.parametrize("doc", _doc_params())
def test_the_doc_examples_run(
    doc: str,
    request: pytest.FixtureRequest,
    kept_engines: KeptEngines,
    examples_workdir: pathlib.Path,
) -> None:
    blocks = EXAMPLES[doc]
    adapters = examples_workdir / "adapters"
    if any("adapters/" in b.code for b in blocks) and not adapters.exists():
        adapters.symlink_to(request.getfixturevalue("adapters_dir"))
    server = None
    if any(b.needs_server for b in blocks):
        # launched now, waited for by the first example that talks to it
        launched: UserServer = request.getfixturevalue("user_server")
        assert not launched.stopped, "the stop journey must run last"
        server = ServerPorts(launched.http_port, launched.grpc_port, launched.wait_ready)
    runner = DocRunner(kept_engines, examples_workdir, adapters, server)
    for block in blocks:
        printed = runner.run(block)
        if "print(" in block.code or block.language != "python":
            assert printed.strip(), f"{block.where} printed nothing"
