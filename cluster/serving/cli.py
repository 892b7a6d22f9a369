"""`pagedserve` on the command line: subcommands, each in its own small function.

`pagedserve generate` runs the default model with no flags at all; `serve` and `bench` live in
`cluster/serving/cli_serve.py`. Every subcommand is one `Subcommand` entry of `SUBCOMMANDS`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cluster.engine.config import EngineConfig
from cluster.engine.errors import ConfigError, RequestRejected
from cluster.serving import cli_serve

DEFAULT_PROMPT = "Explain in two sentences why paging helps an LLM server use memory well."
GENERATE_MAX_TOKENS = 64
"""`pagedserve generate`'s token limit when neither `--max-tokens` nor the model gives one."""


@dataclass(frozen=True)
class Subcommand:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "prompts", nargs="*", help=f"prompts (default: one built-in prompt: {DEFAULT_PROMPT!r})"
    )
    parser.add_argument("--raw", action="store_true", help="send prompts as plain text, no chat")
    # Sampling flags left out take the model's generation defaults, as a request's unset fields
    # do on the server (--generation-config; the default model: its card's temperature 0.2,
    # top_p 0.9); --temperature 0 is greedy.
    unset = "default: the model's generation default, else the engine's"
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help=f"default: the model's max_new_tokens, else {GENERATE_MAX_TOKENS}",
    )
    parser.add_argument("--temperature", type=float, default=None, help=f"{unset} (1.0)")
    parser.add_argument("--top-p", type=float, default=None, help=f"{unset} (1.0)")
    parser.add_argument("--top-k", type=int, default=None, help=f"{unset} (0: off)")
    parser.add_argument("--min-p", type=float, default=None, help=f"{unset} (0: off)")
    parser.add_argument("--repetition-penalty", type=float, default=None, help=f"{unset} (1: off)")
    parser.add_argument("--n", type=int, default=1, help="completions per prompt")
    # sampling is seeded from the engine's --seed (model.seed) and the request's arrival order
    parser.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    parser.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    EngineConfig.add_cli_arguments(parser)


def _run_generate(args: argparse.Namespace) -> int:
    from cluster.engine.llm import LLM
    from cluster.engine.sampling_params import SamplingParams

    config = EngineConfig.from_cli_args(args)
    config = config.single_rank_in_process(vars(args).get("parallel.backend") is not None)
    prompts = args.prompts or [DEFAULT_PROMPT]
    with LLM(config=config) as llm:
        defaults = llm.engine.generation_defaults
        params = SamplingParams(
            n=args.n,
            max_tokens=defaults.max_tokens_or(args.max_tokens, GENERATE_MAX_TOKENS),
            stop=args.stop,
            **defaults.fill(
                temperature=args.temperature,
                top_p=args.top_p,
                top_k=args.top_k,
                min_p=args.min_p,
                repetition_penalty=args.repetition_penalty,
            ),
        )
        if args.raw:
            results = llm.generate(prompts, params)
        else:
            results = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    for prompt, result in zip(prompts, results, strict=True):
        if args.json:
            record = {
                "prompt": prompt,
                "outputs": [
                    {"text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason}
                    for o in result.outputs
                ],
                "usage": vars(result.usage),
            }
            print(json.dumps(record))
            continue
        print(f"### {prompt}")
        for completion in result.outputs:
            print(completion.text)
            print(f"[{completion.finish_reason}, {len(completion.token_ids)} tokens]")
    return 0


SUBCOMMANDS: list[Subcommand] = [
    Subcommand(
        "generate",
        "generate text offline for one or more prompts",
        _add_generate_arguments,
        _run_generate,
    ),
    Subcommand(
        "serve",
        "serve the model over OpenAI-compatible HTTP (:8000) and gRPC (:9000) with Ray Serve",
        cli_serve.add_serve_arguments,
        cli_serve.run_serve,
    ),
    Subcommand(
        "bench",
        "run one of the benchmarks (python -m benchmarks.NAME)",
        cli_serve.add_bench_arguments,
        cli_serve.run_bench,
    ),
]


def build_parser(subcommands: Sequence[Subcommand]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for command in subcommands:
        child = sub.add_parser(command.name, help=command.help)
        command.add_arguments(child)
        child.set_defaults(handler=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser(SUBCOMMANDS)
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except (ConfigError, RequestRejected, ValueError) as error:
        print(f"pagedserve {args.command}: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
