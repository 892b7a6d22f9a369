"""`pagedserve serve` / `pagedserve bench`: config resolution, overrides and bad input."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import yaml

from cluster.engine.config import EngineConfig
from cluster.engine.errors import ConfigError
from cluster.serving.cli import SUBCOMMANDS, build_parser, main
from cluster.serving.cli_serve import (
    BENCHMARKS,
    cap_replicas_to_cores,
    describe_endpoints,
    resolve_serve_config,
    served_app_args,
    shipped_serve_config,
    shutdown_grace_s,
)
from cluster.serving.engine_server import DEPLOYMENT_NAME


def _serve_args(*argv: str) -> argparse.Namespace:
    return build_parser(SUBCOMMANDS).parse_args(["serve", *argv])


def test_shipped_config_is_the_repository_file() -> None:
    repository_file = (
        Path(__file__).resolve().parents[2] / "cluster" / "serving" / "serve_config.yaml"
    )
    assert shipped_serve_config().read_text() == repository_file.read_text()


def test_defaults_listen_on_serve_default_ports() -> None:
    config = resolve_serve_config(_serve_args())
    assert config["http_options"]["port"] == 8000
    assert config["grpc_options"]["port"] == 9000
    lines = describe_endpoints(config)
    assert any("http://localhost:8000/v1" in line for line in lines)
    assert any(":9000" in line and "pagedserve.v1.Generation" in line for line in lines)


def test_flags_override_ports_host_and_model_and_engine_config_still_parses() -> None:
    config = resolve_serve_config(
        _serve_args(
            "--http-port",
            "8123",
            "--grpc-port",
            "9123",
            "--host",
            "127.0.0.1",
            "--model",
            "/m.gguf",
        )
    )
    assert config["http_options"] == {**config["http_options"], "host": "127.0.0.1", "port": 8123}
    assert config["grpc_options"]["port"] == 9123
    engine = config["applications"][0]["args"]["engine"]
    assert engine["model"]["model"] == "/m.gguf"
    assert EngineConfig.build(engine).model.model == "/m.gguf"
    assert any("http://127.0.0.1:8123/v1" in line for line in describe_endpoints(config))


def test_unreadable_or_invalid_config_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        resolve_serve_config(_serve_args("--config", str(tmp_path / "missing.yaml")))
    not_a_mapping = tmp_path / "list.yaml"
    not_a_mapping.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        resolve_serve_config(_serve_args("--config", str(not_a_mapping)))
    bad_schema = tmp_path / "bad.yaml"
    bad_schema.write_text(yaml.safe_dump({"applications": [{"name": "x"}]}))
    with pytest.raises(ConfigError, match="not a valid Ray Serve config"):
        resolve_serve_config(_serve_args("--config", str(bad_schema)))


def test_cli_reports_a_bad_config_with_exit_code_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_every_listed_benchmark_module_exists() -> None:
    benchmarks = Path(__file__).resolve().parents[2] / "benchmarks"
    for name in BENCHMARKS:
        assert (benchmarks / f"{name}.py").is_file(), name


def test_replicas_flag_pins_the_engine_count_and_turns_autoscaling_off() -> None:
    config = resolve_serve_config(_serve_args("--replicas", "3"))
    deployments = [d for app in config["applications"] for d in app.get("deployments", [])]
    engines = [d for d in deployments if d["name"] == DEPLOYMENT_NAME]
    assert engines and len(engines) < len(deployments)  # the ingress is left as configured
    for deployment in engines:
        assert deployment["num_replicas"] == 3
        assert "autoscaling_config" not in deployment
    (ingress,) = [d for d in deployments if d["name"] != DEPLOYMENT_NAME]
    assert ingress == resolve_serve_config(_serve_args())["applications"][0]["deployments"][0]
    with pytest.raises(ConfigError, match="--replicas"):
        resolve_serve_config(_serve_args("--replicas", "0"))


def _engine(config: dict) -> dict:
    (engine,) = [
        d
        for app in config["applications"]
        for d in app.get("deployments", [])
        if d["name"] == DEPLOYMENT_NAME
    ]
    return engine


def test_engine_replicas_are_capped_at_what_the_cores_can_run() -> None:
    shipped = yaml.safe_load(shipped_serve_config().read_text())
    engine_args = shipped["applications"][0]["args"]["engine"]
    assert engine_args["parallel"]["num_threads"] == "auto"
    # "auto" threads take every core: one machine runs one engine, pinned
    on_two_cores = yaml.safe_load(shipped_serve_config().read_text())
    cap_replicas_to_cores(on_two_cores, 2)
    assert _engine(on_two_cores)["num_replicas"] == 1
    assert "autoscaling_config" not in _engine(on_two_cores)
    # with 2 threads per engine, 4 cores run 2 engines: the shipped max (2) stays
    explicit = yaml.safe_load(shipped_serve_config().read_text())
    explicit["applications"][0]["args"]["engine"]["parallel"]["num_threads"] = 2
    expected = _engine(explicit)["autoscaling_config"]["max_replicas"]
    cap_replicas_to_cores(explicit, 4)
    assert _engine(explicit)["autoscaling_config"]["max_replicas"] == expected
    # one thread per engine on 2 cores: the shipped autoscaling is kept as it is
    one_thread = yaml.safe_load(shipped_serve_config().read_text())
    one_thread["applications"][0]["args"]["engine"]["parallel"]["num_threads"] = 1
    cap_replicas_to_cores(one_thread, 2)
    assert _engine(one_thread)["autoscaling_config"]["max_replicas"] == 2
    # many cores, few threads: the config's max is never raised
    big = yaml.safe_load(shipped_serve_config().read_text())
    big["applications"][0]["args"]["engine"]["parallel"]["num_threads"] = 1
    cap_replicas_to_cores(big, 64)
    assert _engine(big)["autoscaling_config"]["max_replicas"] == 2


def test_serve_without_replicas_flag_caps_the_engine_by_this_machines_cores() -> None:
    from workers.config import available_cores

    engine = _engine(resolve_serve_config(_serve_args()))
    if available_cores() < 2 * 2:  # "auto" threads: at most one engine below 4 cores
        assert engine["num_replicas"] == 1
        assert "autoscaling_config" not in engine


def test_shutdown_grace_comes_from_the_flag_else_the_app_args_else_25_s(tmp_path: Path) -> None:
    def grace(config: dict[str, object]) -> tuple[float, float]:
        (app,) = config["applications"]  # type: ignore[misc]
        timeouts = {d["name"]: d["graceful_shutdown_timeout_s"] for d in app["deployments"]}
        return timeouts[DEPLOYMENT_NAME], shutdown_grace_s(config)  # type: ignore[arg-type]

    assert grace(resolve_serve_config(_serve_args())) == (25.0, 25.0)
    flagged = resolve_serve_config(_serve_args("--shutdown-grace-s", "7"))
    assert grace(flagged) == (7.0, 7.0)
    assert flagged["applications"][0]["args"]["shutdown"] == {"grace_s": 7.0}
    assert grace(resolve_serve_config(_serve_args("--grace-period", "3"))) == (3.0, 3.0)
    shipped = yaml.safe_load(shipped_serve_config().read_text())
    shipped["applications"][0]["args"]["shutdown"] = {"grace_s": 12}
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(shipped))
    assert grace(resolve_serve_config(_serve_args("--config", str(path)))) == (12.0, 12.0)
    with pytest.raises(ConfigError, match="shutdown-grace-s"):
        resolve_serve_config(_serve_args("--shutdown-grace-s", "-1"))


def test_a_new_local_cluster_starts_without_rays_dashboard_unless_asked() -> None:
    from cluster.serving.serve_runner import cluster_options

    assert _serve_args().ray_dashboard is False
    assert _serve_args("--ray-dashboard").ray_dashboard is True
    assert cluster_options("local", ray_dashboard=False) == {"include_dashboard": False}
    assert cluster_options("local", ray_dashboard=True) == {"include_dashboard": True}
    # an existing cluster (RAY_ADDRESS) is joined as it is
    assert cluster_options("ray://head:10001", ray_dashboard=False) == {}


def test_a_new_local_cluster_gets_a_slower_serve_control_loop_and_no_idle_workers() -> None:
    from cluster.serving.serve_runner import local_cluster_env

    interval, idle = "RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "RAY_num_workers_soft_limit"
    with_dashboard = local_cluster_env("local", {}, ray_dashboard=True)
    assert with_dashboard == {interval: "0.5", idle: "0"}
    user_set = local_cluster_env("local", {interval: "0.1"}, ray_dashboard=True)
    assert user_set == {idle: "0"}  # the user's stands
    assert local_cluster_env("ray://head:10001", {}, ray_dashboard=False) == {}  # as it is


def test_without_a_dashboard_ray_keeps_no_metrics_task_events_or_loop_stats() -> None:
    """The names must be Ray's own config keys: a misspelt RAY_ variable is silently ignored."""
    import ray

    from cluster.serving.serve_runner import local_cluster_env

    quiet = {
        "RAY_enable_metrics_collection": "0",
        "RAY_task_events_report_interval_ms": "0",
        "RAY_event_stats": "0",
    }
    env = local_cluster_env("local", {}, ray_dashboard=False)
    assert quiet.items() <= env.items()
    assert not quiet.keys() & local_cluster_env("local", {}, ray_dashboard=True).keys()
    assert "RAY_event_stats" not in local_cluster_env("local", {"RAY_event_stats": "1"}, False)
    raylet = Path(ray.__file__).parent / "core/src/ray/raylet/raylet"
    known = raylet.read_bytes()
    for name in quiet:
        assert name.encode() + b"\0" in known, f"{name} is not a Ray config key"


def test_stream_interval_comes_from_the_flag_else_the_shipped_config() -> None:
    shipped = resolve_serve_config(_serve_args())
    assert shipped["applications"][0]["args"]["stream_interval"] == 4
    config = resolve_serve_config(_serve_args("--stream-interval", "1"))
    assert all(app["args"]["stream_interval"] == 1 for app in config["applications"])
    with pytest.raises(ConfigError, match="--stream-interval must be >= 1"):
        resolve_serve_config(_serve_args("--stream-interval", "0"))


def test_served_app_args_are_what_serve_deploys_with_the_same_flags() -> None:
    """What a benchmark runs in process for `--serve-args FLAGS` is the application `serve
    FLAGS` deploys: the shipped one without flags, the flags applied and checked with them."""
    from cluster.serving.app_args import ServeAppArgs

    shipped = yaml.safe_load(shipped_serve_config().read_text())["applications"][0]["args"]
    assert served_app_args([]) == ServeAppArgs.model_validate(shipped)
    flags = ["--dtype", "float32", "--quantized-activations", "--stream-interval", "2"]
    flagged = served_app_args(flags)
    deployed = resolve_serve_config(_serve_args(*flags))["applications"][0]["args"]
    assert flagged == ServeAppArgs.model_validate(deployed)
    model = flagged.engine_config().model
    assert (model.dtype, model.quantized_activations, flagged.stream_interval) == (
        "float32",
        True,
        2,
    )
    assert served_app_args([]).engine_config().model.dtype == "auto"
    with pytest.raises(ConfigError, match="--stream-interval must be >= 1"):
        served_app_args(["--stream-interval", "0"])


def test_stream_chunks_per_step_comes_from_the_flag_else_the_shipped_config() -> None:
    from cluster.serving.app_args import ServeAppArgs

    shipped = resolve_serve_config(_serve_args())
    assert shipped["applications"][0]["args"]["stream_chunks_per_step"] == 2
    for flag, expected in (("4", 4), ("none", None), ("None", None)):
        config = resolve_serve_config(_serve_args("--stream-chunks-per-step", flag))
        for app in config["applications"]:
            assert ServeAppArgs.model_validate(app["args"]).stream_chunks_per_step == expected
    for bad in ("0", "-2", "two", ""):
        with pytest.raises(ConfigError, match="--stream-chunks-per-step"):
            resolve_serve_config(_serve_args("--stream-chunks-per-step", bad))


def test_tool_flags_reach_every_app_and_are_checked() -> None:
    from cluster.serving.app_args import ServeAppArgs

    config = resolve_serve_config(
        _serve_args("--no-enable-auto-tool-choice", "--tool-call-parser", "llama3_json")
    )
    for app in config["applications"]:
        args = ServeAppArgs.model_validate(app["args"])
        assert (args.enable_auto_tool_choice, args.tool_call_parser) == (False, "llama3_json")
    default = ServeAppArgs.model_validate(
        resolve_serve_config(_serve_args())["applications"][0]["args"]
    )
    # auto tool choice on, the parser picked from the model's template
    assert (default.enable_auto_tool_choice, default.tool_call_parser) == (True, None)
    flagged = resolve_serve_config(_serve_args("--enable-auto-tool-choice"))
    assert ServeAppArgs.model_validate(flagged["applications"][0]["args"]).enable_auto_tool_choice
    with pytest.raises(ValueError, match="tool_call_parser"):
        ServeAppArgs.model_validate({"tool_call_parser": "mistral"})
