"""The code examples of README.md and docs/*.md, read from their fenced blocks, and how the suite
runs them as a user would.

A block is one fenced region (```` ```python ````, ```` ```bash ````, ...). `python`, `bash`
and `yaml` (a Serve application's config) blocks are examples: each runs, unless the line right
before its fence is a visible marker `<!-- not-run: why -->` (a GPU, a Kubernetes cluster, a
second server). Blocks with no language, `text` or `json` (diagrams, output, bodies shown) are
not code; any other language is an error, so an example cannot hide behind a tag the suite does
not know. Examples that talk to a server name vLLM's and Serve's default ports,
`localhost:8000` (HTTP) and `localhost:9000` (gRPC); the suite rewrites those to the one server
its fixture started, and nothing else in the example.

Invariant: every block is found exactly once, in file order, with the 1-based line of its
opening fence, so a failure names the place in the doc to fix.
"""

from __future__ import annotations

import pathlib
import re
import shlex
from dataclasses import dataclass

REPO = pathlib.Path(__file__).resolve().parents[2]
RUNNABLE_LANGUAGES = frozenset({"python", "bash", "yaml"})
SHOWN_LANGUAGES = frozenset({"", "text", "json"})
"""Blocks that show something (a diagram, output, a body) rather than do it."""
NOT_RUN = re.compile(r"^<!--\s*not-run:\s*(?P<reason>.+?)\s*-->$")
FENCE = re.compile(r"^(?P<fence>```+)(?P<language>[\w+-]*)\s*$")
HTTP_DEFAULT = "localhost:8000"
GRPC_DEFAULT = "localhost:9000"


@dataclass(frozen=True)
class CodeBlock:
    """One fenced block of a doc: where it is, its language and its text."""

    doc: str
    """The doc's path relative to the repository root (`docs/serving.md`)."""
    line: int
    """The line of the opening fence, 1-based."""
    language: str
    code: str
    not_run: str | None
    """The reason given by a `<!-- not-run: ... -->` marker right before the fence."""

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def is_example(self) -> bool:
        return self.language in RUNNABLE_LANGUAGES

    @property
    def needs_server(self) -> bool:
        return HTTP_DEFAULT in self.code or GRPC_DEFAULT in self.code


def documented_files(root: pathlib.Path = REPO) -> list[pathlib.Path]:
    """README.md, then docs/*.md in name order."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def code_blocks(path: pathlib.Path, root: pathlib.Path = REPO) -> list[CodeBlock]:
    """Every fenced block of one markdown file, in order."""
    doc = path.relative_to(root).as_posix()
    lines = path.read_text().splitlines()
    blocks: list[CodeBlock] = []
    index = 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        fence = opening["fence"]
        end = index + 1
        while end < len(lines) and lines[end].strip() != fence:
            end += 1
        if end == len(lines):
            raise ValueError(f"{doc}:{index + 1}: a fenced block that never closes")
        marker = NOT_RUN.match(lines[index - 1].strip()) if index > 0 else None
        blocks.append(
            CodeBlock(
                doc=doc,
                line=index + 1,
                language=opening["language"],
                code="\n".join(lines[index + 1 : end]) + "\n",
                not_run=marker["reason"] if marker else None,
            )
        )
        index = end + 1
    return blocks


def all_blocks(root: pathlib.Path = REPO) -> list[CodeBlock]:
    return [block for path in documented_files(root) for block in code_blocks(path, root)]


def for_server(code: str, http_port: int, grpc_port: int) -> str:
    """The example pointed at the fixture's server: only the default ports change."""
    return code.replace(HTTP_DEFAULT, f"localhost:{http_port}").replace(
        GRPC_DEFAULT, f"localhost:{grpc_port}"
    )


def shell_commands(code: str) -> list[list[str]]:
    """A bash block's commands as argument lists: backslash continuations and quotes that span
    lines joined, `#` comments dropped."""
    commands: list[list[str]] = []
    pending = ""
    for line in code.splitlines():
        pending = f"{pending}\n{line}" if pending else line
        if pending.rstrip().endswith("\\"):
            pending = pending.rstrip()[:-1]
            continue
        try:
            words = shlex.split(pending, comments=True)
        except ValueError:  # a quote still open: the command goes on
            continue
        if words:
            commands.append(words)
        pending = ""
    if pending.strip():
        raise ValueError(f"a command that never ends: {pending!r}")
    return commands
