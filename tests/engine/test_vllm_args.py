"""vLLM's engine arguments without a setting of their own: `LLM(...)` keywords, `pagedserve
generate`'s flags and `pagedserve serve`'s flags read them alike; the meaningful ones set the
setting they mean, the no-ops are accepted, and a value that has no meaning here is refused with
the argument named."""

from __future__ import annotations

import argparse

import pytest

from cluster.engine.config import EngineConfig
from cluster.engine.errors import ConfigError
from cluster.engine.llm import config_from_kwargs
from cluster.serving.cli import SUBCOMMANDS, build_parser, main
from cluster.serving.cli_serve import resolve_serve_config

NO_OPS = {
    "enforce_eager": True,
    "trust_remote_code": True,
    "disable_log_stats": True,
    "kv_cache_dtype": "auto",
    "quantization": "gguf",
    "pipeline_parallel_size": 1,
}
"""What a vLLM script commonly passes that changes nothing in this engine."""


def generate_flags(argv: list[str]) -> EngineConfig:
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_arguments(parser)
    return EngineConfig.from_cli_args(parser.parse_args(argv))


def serve_engine(*argv: str) -> dict:
    args = build_parser(SUBCOMMANDS).parse_args(["serve", *argv])
    (app,) = resolve_serve_config(args)["applications"]
    return app["args"]["engine"]


def test_llm_keywords_swap_space_is_gib_and_the_no_ops_change_nothing() -> None:
    plain = config_from_kwargs(None, max_num_seqs=4)
    assert config_from_kwargs(None, max_num_seqs=4, **NO_OPS) == plain
    assert config_from_kwargs(None, quantization=None, disable_log_requests=False) == (
        config_from_kwargs(None)
    )
    swapped = config_from_kwargs(None, max_num_seqs=4, swap_space=4, enforce_eager=True)
    assert swapped.cache.swap_space_bytes == 4 * 1024**3
    assert swapped.model_copy(update={"cache": plain.cache}) == plain
    assert config_from_kwargs(None, swap_space=0.5).cache.swap_space_bytes == 512 * 1024**2


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"kv_cache_dtype": "fp8_e5m2"}, r"cache\.kv_cache_dtype: Input should be 'auto', 'int8'"),
        (
            {"kv_cache_dtype": "int8", "kv_layout": "virtual"},
            r"kv_cache_dtype 'int8' needs .*'paged'",
        ),
        ({"quantization": "awq"}, r"quantization='awq' is not supported: .*GGUF"),
        ({"pipeline_parallel_size": 2}, r"pipeline_parallel_size=2 .*tensor_parallel_size"),
        ({"swap_space": -1}, r"swap_space: GiB .*>= 0; got -1"),
        ({"swap_space": "4"}, r"swap_space: GiB"),
        ({"enforce_eager": "yes"}, r"enforce_eager: true or false; got 'yes'"),
        ({"swap_space": 1, "swap_space_bytes": 10}, r"cache\.swap_space_bytes is given twice"),
        ({"kv_cache": 1}, r"unknown setting 'kv_cache'"),
    ],
)
def test_llm_keywords_without_a_meaning_here_are_refused(kwargs: dict, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        config_from_kwargs(None, **kwargs)


def test_generate_flags_read_vllms_spelling() -> None:
    config = generate_flags(
        ["--swap-space", "2", "--enforce-eager", "--trust-remote-code", "-q", "gguf", "-pp", "1"]
    )
    assert config.cache.swap_space_bytes == 2 * 1024**3
    assert config.model_copy(update={"cache": EngineConfig().cache}) == EngineConfig()
    with pytest.raises(ConfigError, match="kv_cache_dtype: Input should be"):
        generate_flags(["--kv-cache-dtype", "fp8_e5m2"])
    assert generate_flags(["--kv-cache-dtype", "fp8"]).cache.kv_cache_dtype == "fp8"
    with pytest.raises(SystemExit):  # argparse: not a number
        generate_flags(["--swap-space", "lots"])


def test_serve_flags_write_swap_space_and_accept_the_no_ops(
    capsys: pytest.CaptureFixture[str],
) -> None:
    shipped = serve_engine()
    engine = serve_engine(
        "--swap-space",
        "1.5",
        "--enforce-eager",
        "--trust-remote-code",
        "--disable-log-stats",
        "--disable-log-requests",
        "--kv-cache-dtype",
        "auto",
        "--quantization",
        "gguf",
    )
    cache = {
        **shipped.get("cache", {}),
        "swap_space_bytes": int(1.5 * 1024**3),
        "kv_cache_dtype": "auto",  # vLLM's flag is the cache setting of that name
    }
    assert engine == {**shipped, "cache": cache}
    assert main(["serve", "--kv-cache-dtype", "fp8_e5m2", "--print-config"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pagedserve serve: ") and "kv_cache_dtype" in err
    assert "Traceback" not in err
    assert main(["serve", "--swap-space", "1", "--swap-space-bytes", "5", "--print-config"]) == 2
    assert "given twice" in capsys.readouterr().err
