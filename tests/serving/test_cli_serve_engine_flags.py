"""`pagedserve serve MODEL` the vLLM way: the model as a positional argument,
`--served-model-name`, one flag per engine setting generated from the config sections, each
overriding only its own field of the config file; and what it refuses before Ray starts."""

from __future__ import annotations

import argparse
import json
import pathlib

import pytest
import yaml

from cluster.engine.config import (
    CacheSettings,
    EngineConfig,
    LoRASettings,
    ModelSettings,
    ParallelSettings,
    SchedulerSettings,
    SpeculativeSettings,
)
from cluster.engine.errors import ConfigError
from cluster.serving.cli import SUBCOMMANDS, build_parser, main
from cluster.serving.cli_serve import (
    APP_IMPORT_PATH,
    check_applications,
    resolve_serve_config,
    shipped_serve_config,
)
from cluster.serving.engine_server import DEPLOYMENT_NAME
from tests.workers.gguf_writer import write_iq4_nl_gguf
from tests.workers.tiny_families import write_family_model
from workers.model_source import resolve_model_path

SECTIONS = {
    "model": ModelSettings,
    "cache": CacheSettings,
    "parallel": ParallelSettings,
    "scheduler": SchedulerSettings,
    "lora": LoRASettings,
    "speculative": SpeculativeSettings,
}
"""Every section of the engine config, spelled out here (not read from the code under test)."""

VLLM_FLAGS = (
    "--served-model-name",
    "--dtype",
    "--max-model-len",
    "--max-num-seqs",
    "--max-num-batched-tokens",
    "--tensor-parallel-size",
    "--enable-expert-parallel",
    "--no-enable-expert-parallel",
    "--enable-prefix-caching",
    "--no-enable-prefix-caching",
    "--enable-chunked-prefill",
    "--block-size",
    "--gpu-memory-utilization",
    "--seed",
    "--host",
    "--port",
    "--enable-lora",
    "--max-loras",
    "--max-lora-rank",
    "--speculative-config",
)
"""`vllm serve` flags we take with vLLM's spelling."""


def _serve_args(*argv: str) -> argparse.Namespace:
    return build_parser(SUBCOMMANDS).parse_args(["serve", *argv])


def _serve_parser() -> argparse.ArgumentParser:
    parser = build_parser(SUBCOMMANDS)
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices["serve"]


def _engine_args(config: dict) -> dict:
    (app,) = config["applications"]
    return app["args"]["engine"]


def test_every_engine_field_is_a_flag_and_serve_help_lists_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    options = {s for action in _serve_parser()._actions for s in action.option_strings}
    for section in SECTIONS.values():
        for name, info in section.model_fields.items():
            flag = "--" + name.replace("_", "-")
            assert flag in options, flag
            if info.annotation is bool:  # vLLM's --enable-X / --no-enable-X
                assert "--no-" + flag.removeprefix("--") in options, flag
    assert set(VLLM_FLAGS) <= options
    with pytest.raises(SystemExit) as done:
        main(["serve", "--help"])
    assert done.value.code == 0
    shown = capsys.readouterr().out
    assert "MODEL" in shown
    for flag in ("--max-num-seqs", "--no-enable-prefix-caching", "--tensor-parallel-size"):
        assert flag in shown
    # choices are shown as argparse shows them
    assert "--dtype {auto,float32,float16,bfloat16}" in shown
    assert "--num-threads NUM_THREADS|auto" in shown


def test_flags_replace_only_their_fields_of_the_config_file() -> None:
    shipped = yaml.safe_load(shipped_serve_config().read_text())
    shipped_engine = shipped["applications"][0]["args"]["engine"]
    flags = [
        "--max-num-seqs",
        "8",
        "--no-enable-prefix-caching",
        "--dtype",
        "float32",
        "--max-model-len",
        "1024",
        "--block-size",
        "32",
    ]
    engine = _engine_args(resolve_serve_config(_serve_args(*flags)))
    # what the file had and no flag touched stays as the file has it, values coerced
    expected = json.loads(json.dumps(shipped_engine))
    expected["scheduler"]["max_num_seqs"] = 8
    expected["model"]["dtype"] = "float32"
    expected["model"]["max_model_len"] = 1024
    expected.setdefault("cache", {}).update(enable_prefix_caching=False, block_size=32)
    assert engine == expected
    overrides = {
        "scheduler": {"max_num_seqs": 8},
        "model": {"dtype": "float32", "max_model_len": 1024},
        "cache": {"enable_prefix_caching": False, "block_size": 32},
    }
    oracle = EngineConfig.build(shipped_engine).with_overrides(overrides)
    assert EngineConfig.build(engine) == oracle
    # no flag: the engine section is the file's, untouched
    assert _engine_args(resolve_serve_config(_serve_args())) == shipped_engine


def test_flags_override_a_config_file_given_with_config(tmp_path: pathlib.Path) -> None:
    custom = yaml.safe_load(shipped_serve_config().read_text())
    custom["applications"][0]["args"]["engine"] = {
        "model": {"model": "/models/a.gguf", "dtype": "bfloat16"},
        "scheduler": {"max_num_seqs": 16, "max_num_batched_tokens": 128},
    }
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(custom))
    engine = _engine_args(
        resolve_serve_config(_serve_args("--config", str(path), "--max-num-batched-tokens", "64"))
    )
    assert engine == {
        "model": {"model": "/models/a.gguf", "dtype": "bfloat16"},
        "scheduler": {"max_num_seqs": 16, "max_num_batched_tokens": 64},
    }
    # an app with no engine args at all takes the flags as its whole engine section
    del custom["applications"][0]["args"]["engine"]
    path.write_text(yaml.safe_dump(custom))
    bare = resolve_serve_config(_serve_args("--config", str(path), "/m.gguf", "--seed", "3"))
    assert _engine_args(bare) == {"model": {"model": "/m.gguf", "seed": 3}}


def test_the_positional_model_is_the_engine_model_and_the_served_name() -> None:
    config = resolve_serve_config(_serve_args("/models/qwen3.gguf"))
    (app,) = config["applications"]
    assert app["args"]["engine"]["model"]["model"] == "/models/qwen3.gguf"
    # the file's context was SmolLM2's: another model runs with its own unless given
    assert "max_model_len" not in app["args"]["engine"]["model"]
    assert _engine_args(resolve_serve_config(_serve_args()))["model"]["max_model_len"] == 2048
    given = resolve_serve_config(_serve_args("/models/qwen3.gguf", "--max-model-len", "512"))
    assert _engine_args(given)["model"]["max_model_len"] == 512
    assert _engine_args(resolve_serve_config(_serve_args("default")))["model"]["max_model_len"]
    smollm2 = str(resolve_model_path("default"))  # the config's model, by its path
    assert _engine_args(resolve_serve_config(_serve_args(smollm2)))["model"]["max_model_len"]
    assert app["args"]["served_model_name"] == "/models/qwen3.gguf"  # vLLM's default
    named = resolve_serve_config(_serve_args("/models/qwen3.gguf", "--served-model-name", "qwen3"))[
        "applications"
    ][0]["args"]
    assert (named["served_model_name"], named["engine"]["model"]["model"]) == (
        "qwen3",
        "/models/qwen3.gguf",
    )
    # --model is the same setting; "default" keeps the config's name for SmolLM2
    flagged = resolve_serve_config(_serve_args("--model", "/models/qwen3.gguf"))
    assert flagged["applications"][0]["args"] == app["args"]
    shipped_name = yaml.safe_load(shipped_serve_config().read_text())["applications"][0]["args"][
        "served_model_name"
    ]
    default = resolve_serve_config(_serve_args("default"))["applications"][0]["args"]
    assert default["served_model_name"] == shipped_name
    assert resolve_serve_config(_serve_args("a.gguf", "--model", "a.gguf"))  # the same twice
    with pytest.raises(ConfigError, match="the model is given twice"):
        resolve_serve_config(_serve_args("a.gguf", "--model", "b.gguf"))
    with pytest.raises(ConfigError, match="one name is served, got 2"):
        resolve_serve_config(_serve_args("a.gguf", "--served-model-name", "a", "b"))


def test_port_is_vllms_spelling_of_the_http_port() -> None:
    config = resolve_serve_config(_serve_args("--port", "8123", "--host", "127.0.0.1"))
    assert (config["http_options"]["port"], config["http_options"]["host"]) == (8123, "127.0.0.1")


def test_tensor_parallel_flag_moves_a_local_engine_to_rank_actors() -> None:
    config = resolve_serve_config(_serve_args("--tensor-parallel-size", "2"))
    parallel = _engine_args(config)["parallel"]
    assert (parallel["tensor_parallel_size"], parallel["backend"]) == (2, "ray")
    (engine,) = [
        d for d in config["applications"][0]["deployments"] if d["name"] == DEPLOYMENT_NAME
    ]
    assert engine["ray_actor_options"]["num_cpus"] == 0  # the rank actors hold the CPUs
    shipped = resolve_serve_config(_serve_args())
    (shipped_engine,) = [
        d for d in shipped["applications"][0]["deployments"] if d["name"] == DEPLOYMENT_NAME
    ]
    assert shipped_engine["ray_actor_options"]["num_cpus"] == 1
    with pytest.raises(ConfigError, match=r"parallel\.tensor_parallel_size: backend 'local'"):
        resolve_serve_config(_serve_args("--tensor-parallel-size", "2", "--backend", "local"))


@pytest.mark.parametrize(
    ("flags", "fragment"),
    [
        (["--max-num-seqs", "many"], r"scheduler\.max_num_seqs"),
        (["--dtype", "float8"], r"model\.dtype"),
        (["--block-size", "12"], r"cache\.block_size must be a power of two"),
        (["--max-num-seqs", "1024"], r"max_num_batched_tokens \(256\) must be >= .*1024"),
        (["--enable-expert-parallel", "--tensor-parallel-size", "0"], "tensor_parallel_size"),
    ],
)
def test_a_bad_flag_value_names_the_field(
    flags: list[str], fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ConfigError, match=fragment):
        resolve_serve_config(_serve_args(*flags))
    assert main(["serve", *flags, "--print-config"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pagedserve serve: ") and "Traceback" not in err


def test_speculative_flags_refine_vllms_speculative_config() -> None:
    spec = '{"method": "ngram", "num_speculative_tokens": 2}'
    section = _engine_args(
        resolve_serve_config(
            _serve_args("--speculative-config", spec, "--num-speculative-tokens", "5")
        )
    )["speculative"]
    assert section == {"speculative_method": "ngram", "num_speculative_tokens": 5}


# --- refused at load, before Ray starts ---------------------------------------------------


def _unknown_architecture(tmp_path: pathlib.Path) -> pathlib.Path:
    model = tmp_path / "deepseek"
    write_family_model("qwen3", model)
    config = json.loads((model / "config.json").read_text())
    config.update(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3")
    (model / "config.json").write_text(json.dumps(config))
    return model


def _moe(tmp_path: pathlib.Path) -> pathlib.Path:
    model = tmp_path / "qwen3_moe"
    write_family_model("qwen3_moe", model)  # 4 heads, 2 KV heads, 6 experts of width 64
    return model


def _run_serve(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """`pagedserve serve ARGV` must refuse before Ray starts: exit 2, one line, no traceback."""
    capsys.readouterr()  # what building the model printed
    assert main(["serve", *argv]) == 2
    captured = capsys.readouterr()
    assert "starting a local Ray cluster" not in captured.out
    assert "Traceback" not in captured.err
    assert captured.err.startswith("pagedserve serve: ")
    return captured.err


def test_an_architecture_we_do_not_run_is_refused(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _run_serve([str(_unknown_architecture(tmp_path))], capsys)
    assert "model.model" in err
    assert "unknown model architecture 'DeepseekV3ForCausalLM'" in err
    assert "'qwen3', 'qwen3_moe'" in err  # what is supported


def test_a_gguf_type_we_cannot_read_is_refused(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _run_serve([str(write_iq4_nl_gguf(tmp_path / "iq.gguf"))], capsys)
    assert "model.model" in err and "'token_embd.weight' has type IQ4_NL" in err
    assert "supported: F32, F16, BF16, Q4_0" in err and "Q4_K, Q5_K, Q6_K" in err


@pytest.mark.parametrize(
    ("flags", "fragments"),
    [
        (
            ["--tensor-parallel-size", "3"],
            ["parallel.tensor_parallel_size", "expert intermediate size 64", "one of [1, 2, 4]"],
        ),
        (
            ["--tensor-parallel-size", "4", "--enable-expert-parallel"],
            ["parallel.enable_expert_parallel", "6 experts", "one of [1, 2]"],
        ),
        (
            ["--tensor-parallel-size", "3", "--enable-expert-parallel"],
            ["parallel.enable_expert_parallel", "3 does not divide", "4 attention heads"],
        ),
        (["--max-model-len", "4096"], ["model.max_model_len 4096", "(512)"]),
    ],
)
def test_a_degree_or_context_the_model_cannot_take_is_refused(
    tmp_path: pathlib.Path,
    capsys: pytest.CaptureFixture[str],
    flags: list[str],
    fragments: list[str],
) -> None:
    err = _run_serve([str(_moe(tmp_path)), *flags], capsys)
    for fragment in fragments:
        assert fragment in err, err


def test_a_dense_model_with_expert_parallel_is_refused(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dense = tmp_path / "qwen3"
    write_family_model("qwen3", dense)
    flags = ["--tensor-parallel-size", "2", "--enable-expert-parallel"]
    err = _run_serve([str(dense), *flags], capsys)
    assert "parallel.enable_expert_parallel" in err and "mixture-of-experts" in err
    err = _run_serve([str(dense), "--tensor-parallel-size", "3"], capsys)
    assert "3 does not divide the model's 4 attention heads" in err and "one of [1, 2, 4]" in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            {"stream_interval": "x"},
            "application 'a' args: stream_interval: Input should be a valid integer, unable to "
            "parse string as an integer",
        ),
        (
            {"engine": {"scheduler": {"max_num_seqs": "many"}}},
            "invalid engine configuration: scheduler.max_num_seqs: Input should be a valid "
            "integer, unable to parse string as an integer or Input should be 'auto'",
        ),
    ],
)
def test_bad_application_args_are_refused_before_ray_naming_the_field(
    args: dict, message: str
) -> None:
    app = {"name": "a", "import_path": APP_IMPORT_PATH, "args": args}
    with pytest.raises(ConfigError) as raised:
        check_applications({"applications": [app]})
    assert str(raised.value) == message
