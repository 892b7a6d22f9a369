"""Regenerate the committed Python stubs from the `.proto` files: `python -m protos.generate`.

The stubs are generated with the repository root as the import root, so `protos/generation.proto`
becomes the module `protos.generation_pb2` and the gRPC stubs import it as
`from protos import generation_pb2`. Output is deterministic for a given grpcio-tools version; the
serving tests regenerate into a temporary directory and compare byte for byte with the committed
files, so a `.proto` edit without regeneration fails the tests.
"""

from __future__ import annotations

import argparse
from importlib import resources
from pathlib import Path

from grpc_tools import protoc

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_FILES: tuple[str, ...] = ("protos/generation.proto",)
"""Paths relative to the repository root (the protoc import root)."""


def generated_names(proto_file: str) -> tuple[str, ...]:
    """The files protoc writes for one `.proto`, relative to the output directory."""
    stem = proto_file.removesuffix(".proto")
    return (f"{stem}_pb2.py", f"{stem}_pb2.pyi", f"{stem}_pb2_grpc.py")


def generate(output_dir: Path) -> list[Path]:
    """Run protoc on every proto file, writing into `output_dir`; return the written files.

    Raises RuntimeError naming the proto file when protoc fails.
    """
    well_known = resources.files("grpc_tools") / "_proto"
    (output_dir / "protos").mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for proto_file in PROTO_FILES:
        args = [
            "grpc_tools.protoc",
            f"--proto_path={REPO_ROOT}",
            f"--proto_path={well_known}",
            f"--python_out={output_dir}",
            f"--pyi_out={output_dir}",
            f"--grpc_python_out={output_dir}",
            str(REPO_ROOT / proto_file),
        ]
        status = protoc.main(args)
        if status != 0:
            raise RuntimeError(f"protoc failed on {proto_file} with exit status {status}")
        written.extend(output_dir / name for name in generated_names(proto_file))
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--output-dir",
        type=Path,
        default=REPO_ROOT,
        help="where to write (protos/… lands under it); default: the repository root",
    )
    args = parser.parse_args(argv)
    for path in generate(args.output_dir):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
