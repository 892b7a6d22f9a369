"""Configuration: YAML and flags, and invalid combinations refused with the field named."""

from __future__ import annotations

import argparse
import pathlib
from dataclasses import fields

import pytest

from cluster.engine.config import EngineConfig
from cluster.engine.errors import ConfigError
from cluster.engine.sampling_params import SamplingParams
from workers.config import WorkerConfig


def parse(argv: list[str]) -> EngineConfig:
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_arguments(parser)
    return EngineConfig.from_cli_args(parser.parse_args(argv))


def test_yaml_then_flags_override(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "engine.yaml"
    path.write_text(
        "cache:\n  block_size: 8\n  num_device_blocks: 100\n"
        "scheduler:\n  preemption_mode: swap\n  max_num_seqs: 4\n"
    )
    config = parse(["--config", str(path), "--max-num-seqs", "6", "--no-enable-prefix-caching"])
    assert config.cache.block_size == 8 and config.cache.num_device_blocks == 100
    assert config.scheduler.preemption_mode == "swap" and config.scheduler.max_num_seqs == 6
    assert config.cache.enable_prefix_caching is False
    worker = config.to_worker_config()
    assert worker.block_size == 8 and worker.num_device_blocks == 100


def test_max_num_seqs_takes_auto_from_flags_and_yaml(tmp_path: pathlib.Path) -> None:
    assert parse(["--max-num-seqs", "auto"]).scheduler.max_num_seqs == "auto"
    path = tmp_path / "engine.yaml"
    path.write_text("scheduler:\n  max_num_seqs: auto\n")
    assert parse(["--config", str(path)]).scheduler.max_num_seqs == "auto"
    assert parse(["--config", str(path), "--max-num-seqs", "8"]).scheduler.max_num_seqs == 8
    resolved = parse(["--config", str(path), "--device", "cpu"]).resolved()
    assert isinstance(resolved.scheduler.max_num_seqs, int)
    assert 0 < resolved.scheduler.max_num_seqs <= resolved.scheduler.max_num_batched_tokens


def test_quantized_decode_is_on_by_default_and_reaches_the_workers(tmp_path: pathlib.Path) -> None:
    assert parse([]).to_worker_config().quantized_decode is True
    assert parse(["--no-quantized-decode"]).to_worker_config().quantized_decode is False
    path = tmp_path / "engine.yaml"
    path.write_text("model:\n  quantized_decode: false\n")
    assert parse(["--config", str(path)]).to_worker_config().quantized_decode is False


def test_quantized_activations_follows_auto_by_default_and_reaches_the_workers(
    tmp_path: pathlib.Path,
) -> None:
    assert parse([]).to_worker_config().quantized_activations == "auto"
    assert parse(["--quantized-activations"]).to_worker_config().quantized_activations is True
    assert parse(["--no-quantized-activations"]).to_worker_config().quantized_activations is False
    path = tmp_path / "engine.yaml"
    path.write_text("model:\n  quantized_activations: true\n")
    assert parse(["--config", str(path)]).to_worker_config().quantized_activations is True
    path.write_text("model:\n  quantized_activations: auto\n")
    given = parse(["--config", str(path)]).to_worker_config()
    assert given.quantized_activations == "auto"
    path.write_text("model:\n  quantized_activations: sometimes\n")
    with pytest.raises(ConfigError, match="quantized_activations"):
        parse(["--config", str(path)])


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (["--block-size", "12"], "cache.block_size"),
        (["--num-device-blocks", "10", "--kv-cache-bytes", "100"], "cache.kv_cache_bytes"),
        (["--backend", "local", "--tensor-parallel-size", "2"], "parallel.tensor_parallel_size"),
        (["--max-num-seqs", "64", "--max-num-batched-tokens", "32"], "scheduler.max_num_seqs"),
        (["--preemption-mode", "swap", "--num-cpu-blocks", "0"], "cache.num_cpu_blocks"),
        (["--preemption-mode", "sometimes"], "scheduler.preemption_mode"),
        (
            ["--no-enable-chunked-prefill", "--max-model-len", "4096"],
            "scheduler.max_num_batched_tokens",
        ),
        (["--watermark", "1.5"], "cache.watermark"),
        (["--num-device-blocks", "0"], "cache.num_device_blocks"),
        (["--num-threads", "0"], "parallel.num_threads"),
        (["--gpu-memory-utilization", "1.5"], "cache.gpu_memory_utilization"),
        (["--max-model-len", "0"], "model.max_model_len"),
    ],
)
def test_invalid_settings_name_the_field(argv: list[str], field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        parse(argv)


def test_what_the_engine_config_accepts_the_workers_accept() -> None:
    """The workers' rules are the config's (one definition): a config that validates builds
    its workers' config, no CPU tier (0 blocks) included."""
    worker = EngineConfig.build({"cache": {"num_cpu_blocks": 0}}).to_worker_config()
    assert worker.num_cpu_blocks == 0


def test_every_knob_the_workers_receive_has_one_default() -> None:
    """A field an engine section shares with `WorkerConfig` takes the workers' default (once
    the engine said auto and the workers float32 for `dtype`), so a config built from defaults
    hands the workers exactly `WorkerConfig()`'s values."""
    defaults = WorkerConfig()
    derived = {"max_num_seqs", "max_loras"}  # the workers get them from other settings
    shared = 0
    for section_name in EngineConfig.section_names():
        section = EngineConfig.model_fields[section_name].annotation
        for name, info in section.model_fields.items():  # type: ignore[union-attr]
            if name in {f.name for f in fields(WorkerConfig)} - derived:
                shared += 1
                assert info.default == getattr(defaults, name), f"{section_name}.{name}"
    assert shared >= 20
    assert defaults.dtype == EngineConfig().model.dtype == "auto"
    handed = EngineConfig().to_worker_config()
    for field in fields(WorkerConfig):
        if field.name not in derived:
            assert getattr(handed, field.name) == getattr(defaults, field.name), field.name


def test_unknown_yaml_field_is_refused(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "engine.yaml"
    path.write_text("cache:\n  blok_size: 8\n")
    with pytest.raises(ConfigError, match=r"cache\.blok_size"):
        EngineConfig.from_yaml(path)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": 0}, "n must be"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": [""]}, "stop"),
        ({"logprobs": 50}, "logprobs"),
        ({"seed": -1}, "seed"),
    ],
)
def test_sampling_params_validation(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_sampling_params_accepts_a_single_stop_string() -> None:
    assert SamplingParams(stop="END").stop == ["END"]


def test_enable_expert_parallel_reaches_the_workers_and_is_checked(tmp_path: pathlib.Path) -> None:
    from tests.workers.tiny_families import write_family_model

    assert parse([]).to_worker_config().enable_expert_parallel is False
    model = tmp_path / "qwen3_moe"
    write_family_model("qwen3_moe", model)  # 6 experts
    config = parse(["--model", str(model), "--enable-expert-parallel"])
    assert config.to_worker_config().enable_expert_parallel is True
    config.check_model()  # one rank holds all 6
    wrong = parse(
        ["--model", str(model), "--enable-expert-parallel", "--tensor-parallel-size", "4"]
    )
    with pytest.raises(ConfigError, match=r"parallel\.tensor_parallel_size .* 6 experts"):
        wrong.check_model()


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {"scheduler": {"max_num_seqs": "many"}},
            "scheduler.max_num_seqs: Input should be a valid integer, unable to parse string as "
            "an integer or Input should be 'auto'",
        ),
        (
            {"scheduler": {"max_num_seqs": 0}},
            "scheduler.max_num_seqs: Input should be greater than 0 or Input should be 'auto'",
        ),
    ],
)
def test_a_field_of_a_number_or_a_word_is_refused_in_one_message(data: dict, message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        EngineConfig.build(data)
    assert str(raised.value) == f"invalid engine configuration: {message}"
