"""Running a doc's examples as a user would, in order, against the shipped model.

Python blocks of one doc run one after another in one namespace (a later block may use what an
earlier one defined, as a reader pasting them into one session would). A bash block's commands:
`curl` runs as it is written, made to fail on an HTTP error (`--fail-with-body`); `pagedserve
generate` runs in process through the CLI's own `main`; `pagedserve serve` runs with
`--print-config` (it parses and checks every flag, starts nothing; the live server is the
fixture's). Any other command must be marked `<!-- not-run: ... -->` in the doc. A yaml block is
a Serve application's entry (`args`, and `import_path` unless it is the shipped one): its
builder builds it, which validates every field (the engine's too) and starts nothing.

Loading SmolLM2 costs many seconds of CPU, so `KeptEngines` hands an example asking for an `LLM`
with a config already loaded in this process that same engine (its `shutdown` waits for the
end of the session); each distinct config still loads once, through the real constructor.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import pathlib
import subprocess
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import yaml

import cluster.engine.llm
import pagedserve
from cluster.engine.config import EngineConfig
from cluster.engine.llm import LLM, config_from_kwargs
from cluster.serving import cli
from cluster.serving.cli_serve import shipped_serve_config
from tests.journeys.doc_examples import CodeBlock, for_server, shell_commands

CURL_FAILS_ON_HTTP_ERRORS = ["--fail-with-body", "--silent", "--show-error", "--max-time", "120"]
ADAPTERS_IN_DOCS = "/adapters/"
"""Where the docs' serving examples keep PEFT adapters; the suite's own stand in for them."""


class KeptLLM(LLM):
    """An `LLM` that outlives the example that made it: `shutdown` is deferred to `close`."""

    def shutdown(self) -> None:
        pass

    def close(self) -> None:
        super().shutdown()


@dataclass
class KeptEngines:
    """One `KeptLLM` per distinct engine config asked for in this process."""

    engines: list[KeptLLM] = field(default_factory=list)

    def llm(
        self, model: str | None = None, *, config: EngineConfig | None = None, **kw: Any
    ) -> LLM:
        wanted = config_from_kwargs(model, config, **kw)
        for engine in self.engines:
            if engine.config == wanted:
                return engine
        engine = KeptLLM(config=wanted)
        self.engines.append(engine)
        return engine

    @contextlib.contextmanager
    def standing_in(self) -> Iterator[None]:
        """`LLM` in `pagedserve` and `cluster.engine.llm` (what the examples import) is `llm`."""
        saved = pagedserve.LLM, cluster.engine.llm.LLM
        pagedserve.LLM = cluster.engine.llm.LLM = self.llm  # type: ignore[assignment,misc]
        try:
            yield
        finally:
            pagedserve.LLM, cluster.engine.llm.LLM = saved

    def close(self) -> None:
        for engine in self.engines:
            engine.close()
        self.engines.clear()


@dataclass(frozen=True)
class ServerPorts:
    http: int
    grpc: int
    wait_ready: Callable[[], None]
    """Called before each example that talks to it (the first waits for the start-up)."""


@dataclass
class DocRunner:
    """Runs one doc's examples in order (see the module doc); `workdir` is the current directory
    the examples see (the files they name, relative, are there)."""

    engines: KeptEngines
    workdir: pathlib.Path
    adapters: pathlib.Path
    """The directory standing in for the docs' `/adapters/`."""
    server: ServerPorts | None = None
    module: types.ModuleType = field(default_factory=lambda: types.ModuleType("doc_example"))
    """The doc's python blocks run as this module's code (pydantic, dataclasses and the like
    look up names through `sys.modules[cls.__module__]`, as they do in a user's script)."""

    def run(self, block: CodeBlock) -> str:
        code = self._as_served(block)
        out = io.StringIO()
        try:
            with (
                contextlib.chdir(self.workdir),
                self.engines.standing_in(),
                contextlib.redirect_stdout(out),
            ):
                if block.language == "python":
                    self._exec(block, code)
                elif block.language == "yaml":
                    print(type(_build_app(block, code)).__name__)
                else:
                    for words in shell_commands(code):
                        self._run_command(block, words, out)
        finally:  # what the reader would have seen, in the test's captured output
            print(f"--- {block.where}\n{out.getvalue()}")
        return out.getvalue()

    def _exec(self, block: CodeBlock, code: str) -> None:
        sys.modules[self.module.__name__] = self.module
        try:
            exec(compile(code, block.where, "exec"), self.module.__dict__)
        finally:
            del sys.modules[self.module.__name__]

    def _as_served(self, block: CodeBlock) -> str:
        code = block.code.replace(ADAPTERS_IN_DOCS, f"{self.adapters}/")
        if self.server is None:
            assert not block.needs_server, f"{block.where} needs the journeys server"
            return code
        if block.needs_server:
            self.server.wait_ready()
        return for_server(code, self.server.http, self.server.grpc)

    def _run_command(self, block: CodeBlock, words: list[str], out: io.StringIO) -> None:
        if words[0] == "curl":
            done = subprocess.run(
                [words[0], *CURL_FAILS_ON_HTTP_ERRORS, *words[1:]],
                capture_output=True,
                text=True,
                cwd=self.workdir,
                timeout=150,
            )
            out.write(done.stdout)
            assert done.returncode == 0, f"{block.where}: {words} -> {done.stdout}{done.stderr}"
        elif words[:2] == ["pagedserve", "generate"]:
            assert cli.main(words[1:]) == 0, f"{block.where}: {words}"
        elif words[:2] == ["pagedserve", "serve"]:
            check = words[1:] if "--print-config" in words else [*words[1:], "--print-config"]
            assert cli.main(check) == 0, f"{block.where}: {words}"
        else:
            raise AssertionError(
                f"{block.where}: the suite cannot run {words[0]!r}: make the example one it can "
                "run, or mark the block `<!-- not-run: why -->`"
            )


def _build_app(block: CodeBlock, code: str) -> Any:
    """The Serve application a yaml block describes, built by its `import_path`'s builder."""
    entry = yaml.safe_load(code)
    assert isinstance(entry, dict) and "args" in entry, f"{block.where}: no application `args`"
    (shipped,) = yaml.safe_load(shipped_serve_config().read_text())["applications"]
    module, name = entry.get("import_path", shipped["import_path"]).split(":")
    return getattr(importlib.import_module(module), name)(entry["args"])
