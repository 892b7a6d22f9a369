"""`pagedserve serve` and `pagedserve bench`: the service and the benchmarks from the command line.

`serve` runs the Ray Serve application of `cluster/serving/serve_config.yaml` (the file
`serve run` takes, shipped inside the package) as `serve run` would, after applying the few
overrides given as flags, and prints where each API listens; it refuses to start on a port
another process listens on (cluster/serving/port_check.py). SIGINT and SIGTERM, to the process
or its whole group, stop it gracefully: new requests are refused, in-flight requests get all but
the last few seconds of `--shutdown-grace-s` (else the app's `shutdown.grace_s`) to finish
before they end with an error event, then Ray stops and it exits 0 within the grace period
(cluster/serving/serve_runner.py). `bench NAME` runs
`python -m benchmarks.NAME` with the remaining arguments.
"""

from __future__ import annotations

import argparse
import runpy
import sys
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from cluster.engine.config import LoRASettings, SpeculativeSettings
from cluster.engine.config_flags import add_section_flags, section_values
from cluster.engine.errors import ConfigError, describe_validation_error
from cluster.serving.app_args import DEFAULT_SHUTDOWN_GRACE_S, ServeAppArgs
from cluster.serving.engine_flags import add_model_arguments, apply_engine_flags
from cluster.serving.lora_args import parse_module_item
from cluster.serving.pd_config import ENGINE_DEPLOYMENTS, disaggregated
from cluster.serving.port_check import GRPC_BIND_HOST, ServedPort, check_ports_free
from cluster.serving.serve_runner import (
    STOP_RESERVE_S,
    apply_grace_period,
    exit_at_once,
    run_config,
)
from workers.config import available_cores

BENCHMARKS: tuple[str, ...] = (
    "block_manager",
    "kernels",
    "workers",
    "throughput",
    "serving",
    "layouts",
    "vs_llamacpp",
    "engine_replay",
)
"""Modules under `benchmarks/` that `pagedserve bench NAME` runs."""


APP_IMPORT_PATH = "cluster.serving.serve_app:build_app"
"""The builder of pagedserve's Serve application, as a Serve config names it."""


def shipped_serve_config() -> Path:
    """The Serve config YAML shipped with the package (`cluster/serving/serve_config.yaml`)."""
    return Path(str(resources.files("cluster.serving") / "serve_config.yaml"))


def served_app_args(flags: Sequence[str]) -> ServeAppArgs:
    """The first application's arguments that `pagedserve serve FLAGS` deploys (the shipped
    config, or --config's, with the flags applied), validated as a replica validates them: what
    a benchmark runs in process to compare like with like."""
    parser = argparse.ArgumentParser(prog="pagedserve serve")
    add_serve_arguments(parser)
    config = resolve_serve_config(parser.parse_args(list(flags)))
    return ServeAppArgs.model_validate(config["applications"][0]["args"])


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        help="a Ray Serve config YAML (default: the shipped cluster/serving/serve_config.yaml)",
    )
    parser.add_argument("--host", default=None, help="HTTP bind address (default: from config)")
    parser.add_argument(
        "--port",
        "--http-port",
        dest="http_port",
        type=int,
        default=None,
        help="HTTP port (default: from config, 8000)",
    )
    parser.add_argument("--grpc-port", type=int, default=None, help="gRPC port (default 9000)")
    parser.add_argument(
        "--pd",
        action="store_true",
        help="prefill/decode disaggregation: a Prefill and a Decode engine deployment behind "
        "the ingress (cluster/serving/pd_app.py); --replicas pins each",
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="pin the engine deployment to N replicas (autoscaling off); default: from config",
    )
    parser.add_argument(
        "--stream-interval",
        type=int,
        default=None,
        help="new tokens per streamed chunk once the first token is out (default: the app's "
        "stream_interval; 1 streams every token)",
    )
    parser.add_argument(
        "--stream-chunks-per-step",
        default=None,
        help="chunks an engine replica sends per decode step at most, about: a chunk also "
        "waits for ceil(running sequences / N) tokens; 'none' turns it off (default: the "
        "app's stream_chunks_per_step)",
    )
    parser.add_argument(
        "--enable-auto-tool-choice",
        action=argparse.BooleanOptionalAction,
        default=None,
        help='answer tool_choice "auto" (the default with tools) by reading calls out of the '
        "text (default: on; --no-enable-auto-tool-choice refuses it with a 400)",
    )
    parser.add_argument(
        "--tool-call-parser",
        default=None,
        choices=["hermes", "llama3_json"],
        help="how tool calls are written in the model's text (default: the one that fits the "
        "model's chat template)",
    )
    parser.add_argument(
        "--reasoning-parser",
        default=None,
        help="split a reasoning model's thinking span into reasoning_content: qwen3 or deepseek_r1",
    )
    parser.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help='speculative decoding, as vLLM spells it: \'{"method": "ngram", '
        '"num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2, '
        '"disable_by_batch_size": 3}\'; "none" turns it off (default: from config)',
    )
    parser.add_argument(
        "--shutdown-grace-s",
        "--grace-period",
        dest="grace_period",
        type=float,
        default=None,
        help="seconds from SIGINT/SIGTERM to the exit: in-flight requests run for all but the "
        f"last {STOP_RESERVE_S:g}, then end with an error event (default: the app's "
        f"shutdown.grace_s, {DEFAULT_SHUTDOWN_GRACE_S:g} s unless set)",
    )
    parser.add_argument(
        "--ready-file",
        default=None,
        help="write this file once every application is running (for scripts and tests)",
    )
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved config and exit"
    )
    parser.add_argument(
        "--ray-dashboard",
        action="store_true",
        help="start Ray's dashboard (:8265) with the local cluster; off by default, since its "
        "processes take CPU from the forward pass (no effect with RAY_ADDRESS set)",
    )
    add_model_arguments(parser)
    add_lora_arguments(parser)


def add_lora_arguments(parser: argparse.ArgumentParser) -> None:
    """LoRA flags, as vLLM spells them: the adapters served from start, runtime updating, and
    the engine's `lora` section (one flag per `LoRASettings` field)."""
    group = parser.add_argument_group("LoRA adapters")
    group.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="adapters every engine replica serves from start: name=path, or a JSON object "
        '{"name": ..., "path": ..., "base_model_name": ...}; turns LoRA on',
    )
    group.add_argument(
        "--allow-runtime-lora-updating",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (admin API keys "
        "only when keys are configured); turns LoRA on (default: from config, off)",
    )
    add_section_flags(group, "lora", LoRASettings)


def resolve_serve_config(args: argparse.Namespace) -> dict[str, Any]:
    """Loads the Serve config, applies the flag overrides and validates it with Ray's schema."""
    from ray.serve.schema import ServeDeploySchema

    path: Path = args.config or shipped_serve_config()
    try:
        config = yaml.safe_load(path.read_text())
    except OSError as error:
        raise ConfigError(f"--config: cannot read {path}: {error}") from error
    except yaml.YAMLError as error:
        raise ConfigError(f"--config: {path} is not valid YAML: {error}") from error
    if not isinstance(config, dict):
        raise ConfigError(f"--config: {path} must hold a mapping, got {type(config).__name__}")
    if getattr(args, "pd", False):
        config = disaggregated(config)
    http = config.setdefault("http_options", {})
    grpc = config.setdefault("grpc_options", {})
    if args.host is not None:
        http["host"] = args.host
    if args.http_port is not None:
        http["port"] = args.http_port
    if args.grpc_port is not None:
        grpc["port"] = args.grpc_port
    apply_lora_flags(config, args)
    if args.stream_interval is not None:
        if args.stream_interval < 1:
            raise ConfigError(f"--stream-interval must be >= 1, got {args.stream_interval}")
        for app in config.get("applications", []):
            app.setdefault("args", {})["stream_interval"] = args.stream_interval
    if args.stream_chunks_per_step is not None:
        chunks = stream_chunks_flag(args.stream_chunks_per_step)
        for app in config.get("applications", []):
            app.setdefault("args", {})["stream_chunks_per_step"] = chunks
    for flag in ("enable_auto_tool_choice", "tool_call_parser", "reasoning_parser"):
        if getattr(args, flag) is not None:
            for app in config.get("applications", []):
                app.setdefault("args", {})[flag] = getattr(args, flag)
    apply_speculative_flag(config, args.speculative_config)
    apply_engine_flags(config, args)
    if args.replicas is not None:
        pin_replicas(config, args.replicas)
    else:
        cap_replicas_to_cores(config, available_cores())
    grace_s = resolve_grace_s(config, args.grace_period)
    apply_grace_period(config, grace_s, ENGINE_DEPLOYMENTS)
    try:
        ServeDeploySchema.model_validate(config)
    except Exception as error:  # pydantic's ValidationError, named by Ray's schema
        raise ConfigError(f"{path}: not a valid Ray Serve config: {error}") from error
    return config


def stream_chunks_flag(flag: str) -> int | None:
    """`--stream-chunks-per-step`'s value: a positive count, or None for 'none'."""
    if flag.strip().lower() == "none":
        return None
    try:
        chunks = int(flag)
    except ValueError:
        chunks = 0
    if chunks < 1:
        raise ConfigError(f"--stream-chunks-per-step must be a count >= 1 or 'none', got {flag!r}")
    return chunks


def apply_speculative_flag(config: dict[str, Any], flag: str | None) -> None:
    """`--speculative-config`: vLLM's JSON replaces every application's engine `speculative`
    section; "none" removes it (speculative decoding off)."""
    if flag is None:
        return
    section = SpeculativeSettings.parse_flag(flag)
    for app in config.get("applications", []):
        engine = app.setdefault("args", {}).setdefault("engine", {})
        if section is None:
            engine.pop("speculative", None)
        else:
            engine["speculative"] = section


def apply_lora_flags(config: dict[str, Any], args: argparse.Namespace) -> None:
    """Writes the LoRA flags given into every application's args (`lora_modules` replaces the
    config's; the engine's `lora` section is updated field by field)."""
    flags = vars(args)
    modules = flags.get("lora_modules")
    parsed = [parse_module_item(item) for item in modules] if modules is not None else None
    given = section_values(args, "lora")
    # coerced as the engine will read them ("4" -> 4), so the printed config shows what runs
    section = LoRASettings.model_validate(given).model_dump(include=set(given))
    for app in config.get("applications", []):
        app_args = app.setdefault("args", {})
        if parsed is not None:
            app_args["lora_modules"] = parsed
        if flags.get("allow_runtime_lora_updating") is not None:
            app_args["allow_runtime_lora_updating"] = flags["allow_runtime_lora_updating"]
        if section:
            app_args.setdefault("engine", {}).setdefault("lora", {}).update(section)


def resolve_grace_s(config: dict[str, Any], flag: float | None) -> float:
    """The shutdown grace period: the flag when given (written into every app's
    `shutdown.grace_s`, so the config shows what runs), else the first app's
    `shutdown.grace_s`, else the default."""
    if flag is not None:
        if flag < 0:
            raise ConfigError(f"--shutdown-grace-s must be >= 0, got {flag}")
        for app in config.get("applications", []):
            app.setdefault("args", {}).setdefault("shutdown", {})["grace_s"] = flag
        return flag
    for app in config.get("applications", []):
        grace = ((app.get("args") or {}).get("shutdown") or {}).get("grace_s")
        if grace is not None:
            if not isinstance(grace, int | float) or grace < 0:
                raise ConfigError(f"shutdown.grace_s must be a number >= 0, got {grace!r}")
            return float(grace)
    return DEFAULT_SHUTDOWN_GRACE_S


def shutdown_grace_s(config: dict[str, Any]) -> float:
    """The grace period `resolve_serve_config` settled on (the engine deployment's)."""
    for app in config.get("applications", []):
        for deployment in app.get("deployments", []):
            if deployment.get("name") in ENGINE_DEPLOYMENTS:
                return float(deployment["graceful_shutdown_timeout_s"])
    return DEFAULT_SHUTDOWN_GRACE_S


def pin_replicas(config: dict[str, Any], replicas: int) -> None:
    """Sets `num_replicas` on every engine deployment and drops its `autoscaling_config`: Serve
    takes one or the other, and a pinned count must not grow (e.g. two engines on two cores).
    The ingress keeps its own setting: it scales apart from the engines."""
    if replicas < 1:
        raise ConfigError(f"--replicas must be at least 1, got {replicas}")
    for app in config.get("applications", []):
        for deployment in app.get("deployments", []):
            if deployment.get("name") in ENGINE_DEPLOYMENTS:
                deployment.pop("autoscaling_config", None)
                deployment["num_replicas"] = replicas


def engine_cores(deployment: dict[str, Any], engine: dict[str, Any]) -> int:
    """The cores one engine replica keeps busy: its ranks' torch threads (`parallel.num_threads`;
    "auto" takes every core), else the actor's `num_cpus` per rank."""
    parallel = engine.get("parallel") or {}
    ranks = int(parallel.get("tensor_parallel_size", 1) or 1)
    threads = parallel.get("num_threads")
    if threads == "auto":
        return available_cores()
    if threads is not None:
        return int(threads) * ranks
    num_cpus = (deployment.get("ray_actor_options") or {}).get("num_cpus", 1)
    return max(1, int(float(num_cpus or 1))) * ranks


def cap_replicas_to_cores(config: dict[str, Any], cores: int) -> None:
    """`pagedserve serve` runs on one machine: an autoscaled engine deployment may not grow past
    the replicas its cores can run (`cores // engine_cores`, at least `min_replicas`); two engines
    on the cores of one only fight for them. Where that leaves min == max the count is pinned."""
    for app in config.get("applications", []):
        engine = (app.get("args") or {}).get("engine") or {}
        for deployment in app.get("deployments", []):
            autoscaling = deployment.get("autoscaling_config")
            if deployment.get("name") not in ENGINE_DEPLOYMENTS or not autoscaling:
                continue
            fits = max(1, cores // engine_cores(deployment, engine))
            low = int(autoscaling.get("min_replicas", 1))
            if int(autoscaling.get("max_replicas", 1)) <= fits:
                continue
            if fits <= low:
                deployment.pop("autoscaling_config")
                deployment["num_replicas"] = max(low, 1)
            else:
                autoscaling["max_replicas"] = fits


def describe_endpoints(config: dict[str, Any]) -> list[str]:
    """One line per API: where it listens once the application is up."""
    http = config.get("http_options", {})
    grpc = config.get("grpc_options", {})
    host = http.get("host", "127.0.0.1")
    shown_host = "localhost" if host in ("0.0.0.0", "::") else host
    http_port = http.get("port", 8000)
    grpc_port = grpc.get("port", 9000)
    lines = [
        f"OpenAI-compatible HTTP: http://{shown_host}:{http_port}/v1 "
        "(/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics)",
        f"gRPC: {shown_host}:{grpc_port} (pagedserve.v1.Generation, grpc.health.v1.Health)",
    ]
    for app in config.get("applications", []):
        lines.append(f"application {app.get('name', 'default')!r} at route {app['route_prefix']}")
    return lines


def served_ports(config: dict[str, Any]) -> list[ServedPort]:
    """The ports the resolved `config` listens on: HTTP on its host, gRPC (when it serves any
    gRPC service) on every address, as Serve binds them."""
    http = config.get("http_options", {})
    grpc = config.get("grpc_options", {})
    ports = [ServedPort("HTTP", "--port", http.get("host", "127.0.0.1"), http.get("port", 8000))]
    if grpc.get("grpc_servicer_functions"):
        ports.append(ServedPort("gRPC", "--grpc-port", GRPC_BIND_HOST, grpc.get("port", 9000)))
    return ports


def check_applications(config: dict[str, Any]) -> None:
    """Validates the args of each application built by `APP_IMPORT_PATH` and checks its engine
    against the model's metadata (architecture, GGUF tensor types, context, parallel degrees)
    before Ray starts: a refusal is one ConfigError naming the field, not a replica failing in
    its constructor again and again."""
    from pydantic import ValidationError

    from cluster.serving.app_args import ServeAppArgs

    for app in config.get("applications", []):
        if app.get("import_path") != APP_IMPORT_PATH:
            continue
        try:
            app_args = ServeAppArgs.model_validate(app.get("args") or {})
        except ValidationError as error:
            problems = describe_validation_error(error)
            raise ConfigError(f"application {app.get('name')!r} args: {problems}") from None
        app_args.engine_config().check_model()


def run_serve(args: argparse.Namespace) -> int:
    config = resolve_serve_config(args)
    if args.print_config:
        print(yaml.safe_dump(config, sort_keys=False))
        return 0
    check_ports_free(served_ports(config))
    check_applications(config)
    print("pagedserve serve: starting a local Ray cluster and the Serve application; once ready:")
    for line in describe_endpoints(config):
        print(f"  {line}")
    sys.stdout.flush()
    exit_at_once(
        run_config(
            config,
            grace_s=shutdown_grace_s(config),
            ready_file=args.ready_file,
            ray_dashboard=args.ray_dashboard,
        )
    )


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", choices=BENCHMARKS, help="which benchmark to run")
    parser.add_argument(
        "bench_args", nargs=argparse.REMAINDER, help="arguments for the benchmark (e.g. --json)"
    )


def run_bench(args: argparse.Namespace) -> int:
    module = f"benchmarks.{args.name}"
    sys.argv = [module, *args.bench_args]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as done:
        return int(done.code or 0)
    return 0
