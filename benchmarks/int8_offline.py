"""Offline throughput of `LLM(...)` with and without `quantized_activations` on the same prompts.

`python -m benchmarks.int8_offline --json [--prompts 64] [--max-tokens 128] [--max-num-seqs 64]
[--modes float32,float32+int8] [--threads auto]` generates, for each mode in turn in one
process, greedy continuations of `--prompts` natural-text chat prompts with `ignore_eos` (so
every mode produces exactly prompts x max_tokens tokens), and reports output tokens per second,
the wall time, and how many of the greedy texts equal the first mode's.

Modes: a dtype (`float32`, `bfloat16`), optionally `+int8` (`quantized_activations=True`).
Prompts: "Summarize this documentation" over the docstrings of a Python standard-library module
and its public members (English prose shipped with every Python, cut to 600-1200 characters:
153-455 tokens, 259 on average, with the chat template): deterministic, no download, not random
token ids.
"""

from __future__ import annotations

import argparse
import importlib
import json
import time
from typing import Any

MODULES = (
    "argparse", "asyncio", "base64", "bisect", "calendar", "cmd", "codecs", "collections",
    "colorsys", "configparser", "contextlib", "copy", "csv", "dataclasses", "datetime",
    "decimal", "difflib", "doctest", "email", "enum", "filecmp", "fnmatch", "fractions",
    "ftplib", "functools", "getopt", "gettext", "glob", "graphlib", "gzip", "hashlib", "heapq",
    "hmac", "html", "http", "imaplib", "inspect", "ipaddress", "json", "locale", "logging",
    "lzma", "mailbox", "mimetypes", "numbers", "operator", "optparse", "pathlib", "pickle",
    "pickletools", "pprint", "queue", "quopri", "random", "re", "sched", "secrets", "selectors",
    "shelve", "shlex", "shutil", "smtplib", "socket", "socketserver", "statistics", "string",
    "struct", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "timeit", "token",
    "tokenize", "trace", "traceback", "typing", "unittest", "uuid", "warnings", "wave",
    "weakref", "webbrowser", "zipfile", "zipimport",
)  # fmt: skip


def documentation_prompts(count: int) -> list[str]:
    """`count` chat prompts, each over 600-1200 characters of standard-library docstrings (a
    module's own, then its public members', in order, whitespace collapsed)."""
    prompts = []
    for name in MODULES:
        module = importlib.import_module(name)
        members = [getattr(module, attr, None) for attr in sorted(dir(module))]
        docs = [module.__doc__] + [getattr(m, "__doc__", None) for m in members if callable(m)]
        text = ""
        for doc in dict.fromkeys(d for d in docs if isinstance(d, str)):
            text += " " + " ".join(doc.split())
            if len(text) >= 600:
                cut = text[:1200].rsplit(" ", 1)[0].strip()
                prompts.append(f"Summarize this documentation in plain words:\n\n{cut}")
                break
        if len(prompts) == count:
            return prompts
    raise ValueError(f"only {len(prompts)} standard-library modules have enough docstrings")


def run_mode(
    mode: str, prompts: list[str], max_tokens: int, max_num_seqs: int, threads: int | str
) -> dict[str, Any]:
    from cluster.engine.llm import LLM
    from cluster.engine.sampling_params import SamplingParams

    dtype, _, extra = mode.partition("+")
    began = time.perf_counter()
    llm = LLM(
        dtype=dtype,
        quantized_activations=extra == "int8",
        max_num_seqs=max_num_seqs,
        num_threads=threads,
    )
    loaded = time.perf_counter() - began
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    conversations = [[{"role": "user", "content": prompt}] for prompt in prompts]
    try:
        began = time.perf_counter()
        outputs = llm.chat(conversations, params)
        wall = time.perf_counter() - began
    finally:
        llm.shutdown()
    tokens = sum(len(output.outputs[0].token_ids) for output in outputs)
    return {
        "mode": mode,
        "load_s": round(loaded, 1),
        "wall_s": round(wall, 1),
        "output_tokens": tokens,
        "output_tok_per_s": round(tokens / wall, 1),
        "texts": [output.outputs[0].text for output in outputs],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--modes", default="float32,float32+int8")
    parser.add_argument("--threads", default="auto", help="torch threads: auto or a number")
    args = parser.parse_args()
    prompts = documentation_prompts(args.prompts)
    threads = args.threads if args.threads == "auto" else int(args.threads)
    runs = [
        run_mode(mode, prompts, args.max_tokens, args.max_num_seqs, threads)
        for mode in args.modes.split(",")
    ]
    first = runs[0]["texts"]
    for run in runs:
        texts = run.pop("texts")
        run["same_text_as_first_mode"] = sum(a == b for a, b in zip(first, texts, strict=True))
        run["speed_over_first_mode"] = round(
            run["output_tok_per_s"] / runs[0]["output_tok_per_s"], 2
        )
    print(json.dumps({"prompts": len(prompts), "runs": runs}, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
