"""The shipped Serve config is a valid Ray Serve config whose engine section is a valid engine
config, and it describes the same application as the Helm chart."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ray.serve.config import gRPCOptions
from ray.serve.schema import ServeDeploySchema

from cluster.engine.config import EngineConfig

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIG_PATH = REPO_ROOT / "cluster" / "serving" / "serve_config.yaml"


def load_config() -> ServeDeploySchema:
    return ServeDeploySchema.model_validate(yaml.safe_load(CONFIG_PATH.read_text()))


def test_serve_config_parses_with_rays_schema_on_the_default_ports() -> None:
    config = load_config()
    assert config.http_options.port == 8000
    assert config.grpc_options.port == 9000
    callables = gRPCOptions(
        grpc_servicer_functions=config.grpc_options.grpc_servicer_functions
    ).grpc_servicer_func_callable
    assert [f"{f.__module__}.{f.__name__}" for f in callables] == [
        "cluster.serving.grpc_wire.add_GenerationServicer_to_server",
        "cluster.serving.grpc_wire.add_HealthServicer_to_server",
    ]


def test_the_application_autoscales_and_its_engine_section_is_an_engine_config() -> None:
    (app,) = load_config().applications
    assert app.route_prefix == "/"
    assert app.import_path == "cluster.serving.serve_app:build_app"
    ingress, deployment = app.deployments
    assert (ingress.name, deployment.name) == ("OpenAIIngress", "GenerationServer")
    autoscaling = deployment.autoscaling_config
    assert 1 <= autoscaling["min_replicas"] < autoscaling["max_replicas"]
    assert autoscaling["target_ongoing_requests"] <= deployment.max_ongoing_requests
    engine = EngineConfig.build(app.args["engine"])
    assert engine.model.model == "default"
    assert engine.parallel.tensor_parallel_size == 1
    # the running sequences this CPU (or GPU) runs best, resolved in the engine's process
    assert engine.scheduler.max_num_seqs == "auto"


def test_it_agrees_with_the_helm_chart_on_the_application() -> None:
    helm = pytest.importorskip("helm_python", reason="helm-python-sdk ships Linux x86_64 only")
    with helm.Chart.load(REPO_ROOT / "helm" / "pagedserve") as chart:
        rendered = chart.render(name="demo")
    rayservice = yaml.safe_load(rendered["pagedserve/templates/rayservice.yaml"])
    chart_config = ServeDeploySchema.model_validate(
        yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    )
    local = load_config()
    assert chart_config.grpc_options == local.grpc_options
    assert chart_config.http_options == local.http_options
    (chart_app,), (local_app,) = chart_config.applications, local.applications
    assert (chart_app.name, chart_app.route_prefix, chart_app.import_path) == (
        local_app.name,
        local_app.route_prefix,
        local_app.import_path,
    )
    assert [d.name for d in chart_app.deployments] == [d.name for d in local_app.deployments]
    assert chart_app.args["served_model_name"] == local_app.args["served_model_name"]
    (_, chart_deployment), (_, local_deployment) = chart_app.deployments, local_app.deployments
    for key in ("policy",):
        assert chart_deployment.autoscaling_config[key] == local_deployment.autoscaling_config[key]
    assert chart_deployment.request_router_config == local_deployment.request_router_config


def test_the_deployment_uses_our_router_and_autoscaling_policy() -> None:
    from ray.serve.config import AutoscalingConfig, RequestRouterConfig

    from cluster.serving.autoscaling import KVPressurePolicy
    from cluster.serving.routing import PrefixAwareRouter

    _, deployment = load_config().applications[0].deployments
    router = RequestRouterConfig.model_validate(deployment.request_router_config)
    assert router.get_request_router_class() is PrefixAwareRouter
    autoscaling = AutoscalingConfig.model_validate(deployment.autoscaling_config)
    assert autoscaling.policy.policy_function == "cluster.serving.autoscaling:KVPressurePolicy"
    policy_class = autoscaling.policy.get_policy()
    assert policy_class.__name__ == KVPressurePolicy.__name__
