"""The disaggregated application's configuration, without Ray: `pagedserve serve --pd` turns
the shipped config into a valid Serve config with `Prefill` and `Decode` deployments that are
pinned and timed like the engine deployment; `PDAppArgs` merges each side's engine section over
the shared one and refuses sides that could not continue each other's KV; the decode router
ranks by KV pressure."""

from __future__ import annotations

import argparse
import random
from typing import Any

import pytest
from pydantic import ValidationError

from cluster.engine.errors import ConfigError
from cluster.serving.cli_serve import add_serve_arguments, resolve_serve_config
from cluster.serving.pd_args import PDAppArgs
from cluster.serving.pd_config import PD_BUILDER
from cluster.serving.pd_routing import rank_by_pressure
from cluster.serving.routing import LoadReport, ReplicaView, RoutingPolicy


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args(list(argv))


def deployments(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    (app,) = config["applications"]
    return {d["name"]: d for d in app["deployments"]}


def test_pd_flag_splits_the_engine_deployment() -> None:
    config = resolve_serve_config(parse("--pd", "--replicas", "2", "--shutdown-grace-s", "7"))
    (app,) = config["applications"]
    assert app["import_path"] == PD_BUILDER
    assert {"prefill", "decode"} <= set(app["args"])
    by_name = deployments(config)
    assert set(by_name) == {"OpenAIIngress", "Prefill", "Decode"}
    for side in ("Prefill", "Decode"):
        assert by_name[side]["num_replicas"] == 2 and "autoscaling_config" not in by_name[side]
        assert by_name[side]["graceful_shutdown_timeout_s"] == 7
    assert by_name["OpenAIIngress"]["graceful_shutdown_timeout_s"] > 7
    assert "request_router_config" not in by_name["Decode"]  # the builder's KV-pressure router
    PDAppArgs.model_validate(app["args"])
    colocated = resolve_serve_config(parse())
    assert "GenerationServer" in deployments(colocated)


def test_role_args_merge_and_check() -> None:
    args = PDAppArgs.model_validate(
        {
            "engine": {"model": {"dtype": "float32"}, "scheduler": {"max_num_seqs": 8}},
            "prefill": {"engine": {"scheduler": {"max_num_batched_tokens": 512}}},
            "decode": {
                "engine": {"scheduler": {"max_num_seqs": 64}},
                "deployment": {"num_replicas": 3},
            },
        }
    )
    prefill = args.role_args("prefill").engine_config()
    decode = args.role_args("decode").engine_config()
    assert prefill.scheduler.max_num_batched_tokens == 512 and prefill.scheduler.max_num_seqs == 8
    assert decode.scheduler.max_num_seqs == 64 and decode.model.dtype == "float32"
    assert args.decode.deployment == {"num_replicas": 3}
    with pytest.raises(ValidationError, match="unknown Serve option"):
        PDAppArgs.model_validate({"decode": {"deployment": {"replicas": 2}}})
    with pytest.raises(ValidationError, match="not both"):
        PDAppArgs.model_validate(
            {"prefill": {"deployment": {"num_replicas": 1, "autoscaling_config": {}}}}
        )
    different = PDAppArgs.model_validate({"decode": {"engine": {"cache": {"block_size": 32}}}})
    with pytest.raises(ConfigError, match=r"share engine\.cache"):
        different.check()


def view(name: str, kv: float, ongoing: int = 0, waiting: int = 0) -> ReplicaView:
    return ReplicaView(name, ongoing, 100, LoadReport(0, waiting, kv))


def test_decode_router_ranks_by_kv_pressure() -> None:
    policy, rng = RoutingPolicy(), random.Random(0)
    views = [view("full", 0.97), view("half", 0.5), view("empty", 0.0, ongoing=3), view("low", 0.1)]
    ranks = rank_by_pressure(views, policy, rng)
    assert ranks == [["empty", "low"], ["half", "full"]]
    busy_tie = [view("busy", 0.31, ongoing=5), view("idle", 0.32)]
    assert rank_by_pressure(busy_tie, policy, rng)[0] == ["idle", "busy"]
    assert rank_by_pressure([], policy, rng) == []
