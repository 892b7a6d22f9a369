"""The Helm chart, rendered by Helm's own template engine (helm-python-sdk binds the Go library).

Checks what Kubernetes and KubeRay will read: the RayService's embedded Serve config parses into Ray
Serve's own config schema and names our gRPC servicers, GPU resources and placement follow the
tensor-parallel degree, and the Service and optional ServiceMonitor expose the right ports.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from ray.serve.config import gRPCOptions
from ray.serve.schema import ServeDeploySchema

from cluster.engine.config import EngineConfig
from cluster.serving.app_args import ServeAppArgs

helm = pytest.importorskip("helm_python", reason="helm-python-sdk ships Linux x86_64 wheels only")

CHART_DIR = Path(__file__).resolve().parents[2] / "helm" / "pagedserve"
RELEASE = "demo"
Manifests = dict[str, dict[str, Any]]


@pytest.fixture(scope="module")
def chart() -> Iterator[Any]:
    with helm.Chart.load(CHART_DIR) as loaded:
        yield loaded


def render(chart: Any, values: dict[str, Any] | None = None) -> Manifests:
    """Render and parse; key each Kubernetes object by its kind (the chart has one of each)."""
    rendered: dict[str, str] = chart.render(values=values, name=RELEASE, namespace="serving")
    objects: Manifests = {}
    for text in rendered.values():
        for document in yaml.safe_load_all(text):
            if document:
                assert document["kind"] not in objects
                objects[document["kind"]] = document
    return objects


def serve_config(objects: Manifests) -> ServeDeploySchema:
    raw = yaml.safe_load(objects["RayService"]["spec"]["serveConfigV2"])
    return ServeDeploySchema.model_validate(raw)


def gpu_worker_container(objects: Manifests) -> dict[str, Any]:
    (group,) = objects["RayService"]["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    (container,) = group["template"]["spec"]["containers"]
    return container


def test_chart_lints_clean(chart: Any) -> None:
    report = helm.lint(CHART_DIR, strict=True)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_default_values_render_a_rayservice_with_a_valid_serve_config(chart: Any) -> None:
    objects = render(chart)
    assert set(objects) == {"RayService", "Service"}
    assert objects["RayService"]["apiVersion"] == "ray.io/v1"

    config = serve_config(objects)
    assert config.http_options.port == 8000
    assert config.grpc_options.port == 9000
    # The proxy imports these by path inside every node; they must resolve here too.
    servicers = gRPCOptions(
        grpc_servicer_functions=config.grpc_options.grpc_servicer_functions
    ).grpc_servicer_func_callable
    assert [f.__name__ for f in servicers] == [
        "add_GenerationServicer_to_server",
        "add_HealthServicer_to_server",
    ]
    (app,) = config.applications
    assert app.import_path == "cluster.serving.serve_app:build_app"
    engine = EngineConfig.build(app.args["engine"])
    assert engine.parallel.tensor_parallel_size == 1
    assert engine.model.model == "default"
    assert app.args["served_model_name"] == "SmolLM2-135M-Instruct"
    assert ServeAppArgs.model_validate(app.args).stream_interval == 1  # every token, on GPUs
    ingress, deployment = app.deployments
    assert (ingress.name, deployment.name) == ("OpenAIIngress", "GenerationServer")
    assert deployment.autoscaling_config["min_replicas"] == 1
    assert deployment.autoscaling_config["max_replicas"] == 4
    assert deployment.placement_group_bundles == [{"CPU": 1}, {"CPU": 1, "GPU": 1}]
    assert deployment.placement_group_strategy == "STRICT_PACK"

    cluster = objects["RayService"]["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    assert cluster["autoscalerOptions"]["idleTimeoutSeconds"] == 60
    resources = gpu_worker_container(objects)["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == 1
    assert resources["requests"]["nvidia.com/gpu"] == 1


def test_service_exposes_http_and_grpc_on_serve_pods(chart: Any) -> None:
    objects = render(chart)
    service = objects["Service"]
    ports = {p["name"]: (p["port"], p["targetPort"]) for p in service["spec"]["ports"]}
    assert ports["http"] == (8000, "serve")
    assert ports["grpc"] == (9000, "grpc")
    selector = service["spec"]["selector"]
    assert selector["ray.io/serve"] == "true"
    # Every selector label is on the head and worker pod templates, so the Service finds them.
    cluster = objects["RayService"]["spec"]["rayClusterConfig"]
    head_labels = cluster["headGroupSpec"]["template"]["metadata"]["labels"]
    worker_labels = cluster["workerGroupSpecs"][0]["template"]["metadata"]["labels"]
    own = {k: v for k, v in selector.items() if k != "ray.io/serve"}
    assert own.items() <= head_labels.items()
    assert own.items() <= worker_labels.items()
    head_ports = {p["name"]: p["containerPort"] for p in _head_container(objects)["ports"]}
    assert head_ports["serve"] == 8000
    assert head_ports["grpc"] == 9000


def _head_container(objects: Manifests) -> dict[str, Any]:
    head = objects["RayService"]["spec"]["rayClusterConfig"]["headGroupSpec"]
    (container,) = head["template"]["spec"]["containers"]
    return container


def test_non_default_values_flow_into_every_object(chart: Any) -> None:
    values = {
        "engine": {
            "model": {"model": "/models/llama.gguf", "max_model_len": 4096},
            "parallel": {"tensor_parallel_size": 2},
            "cache": {"block_size": 32},
        },
        "servedModelName": "llama",
        "gpuWorkers": {"gpusPerPod": 4, "maxReplicas": 8},
        "serve": {
            "httpPort": 8100,
            "grpcPort": 9100,
            "autoscaling": {"minReplicas": 2, "maxReplicas": 6, "targetOngoingRequests": 4},
            "streamInterval": 8,
        },
        "autoscaler": {"enabled": False},
        "serviceMonitor": {"enabled": True, "labels": {"release": "prom"}},
        "image": {"repository": "registry.local/pagedserve", "tag": "abc"},
    }
    objects = render(chart, values)
    assert set(objects) == {"RayService", "Service", "ServiceMonitor"}

    config = serve_config(objects)
    assert (config.http_options.port, config.grpc_options.port) == (8100, 9100)
    (app,) = config.applications
    assert app.args["served_model_name"] == "llama"
    assert ServeAppArgs.model_validate(app.args).stream_interval == 8
    engine = EngineConfig.build(app.args["engine"])
    assert engine.model.model == "/models/llama.gguf"
    assert engine.model.max_model_len == 4096
    assert engine.model.dtype == "auto"  # a default kept beside the overrides
    assert engine.parallel.tensor_parallel_size == 2
    assert engine.cache.block_size == 32
    ingress, deployment = app.deployments
    assert (ingress.name, deployment.name) == ("OpenAIIngress", "GenerationServer")
    assert deployment.autoscaling_config["min_replicas"] == 2
    assert deployment.autoscaling_config["max_replicas"] == 6
    assert deployment.autoscaling_config["target_ongoing_requests"] == 4
    assert deployment.placement_group_bundles == [{"CPU": 1}] + [{"CPU": 1, "GPU": 1}] * 2

    cluster = objects["RayService"]["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is False
    assert "autoscalerOptions" not in cluster
    assert cluster["workerGroupSpecs"][0]["maxReplicas"] == 8
    container = gpu_worker_container(objects)
    assert container["image"] == "registry.local/pagedserve:abc"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 4

    ports = {p["name"]: p["port"] for p in objects["Service"]["spec"]["ports"]}
    assert (ports["http"], ports["grpc"]) == (8100, 9100)
    monitor = objects["ServiceMonitor"]
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert {e["port"] for e in monitor["spec"]["endpoints"]} == {"http", "ray-metrics"}
    assert monitor["spec"]["selector"]["matchLabels"].items() <= (
        objects["Service"]["metadata"]["labels"].items()
    )


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"engine": {"parallel": {"tensor_parallel_size": 2}}, "gpuWorkers": {"gpusPerPod": 1}},
            "tensor_parallel_size cannot exceed gpuWorkers.gpusPerPod",
        ),
        (
            {"engine": {"parallel": {"tensor_parallel_size": 0}}},
            "tensor_parallel_size must be at least 1",
        ),
        (
            {"serve": {"autoscaling": {"minReplicas": 5, "maxReplicas": 2}}},
            "minReplicas cannot exceed",
        ),
    ],
)
def test_inconsistent_values_fail_to_render_with_a_clear_message(
    chart: Any, values: dict[str, Any], message: str
) -> None:
    with pytest.raises(helm.HelmRenderError, match=message):
        render(chart, values)


def test_routing_and_kv_autoscaling_follow_the_values(chart: Any) -> None:
    _, default = serve_config(render(chart)).applications[0].deployments
    assert default.request_router_config["request_router_class"] == (
        "cluster.serving.routing:PrefixAwareRouter"
    )
    assert default.autoscaling_config["policy"] == {
        "policy_function": "cluster.serving.autoscaling:KVPressurePolicy",
        "policy_kwargs": {"target_kv_utilization": 0.8},
    }
    values = {
        "serve": {
            "routing": {"prefixAware": False},
            "autoscaling": {"targetKvUtilization": 0.6},
        }
    }
    _, changed = serve_config(render(chart, values)).applications[0].deployments
    assert "request_router_config" not in changed.model_fields_set
    assert changed.autoscaling_config["policy"]["policy_kwargs"] == {"target_kv_utilization": 0.6}


def test_lora_values_become_the_apps_lora_args(chart: Any) -> None:
    from cluster.serving.app_args import ServeAppArgs

    (plain,) = serve_config(render(chart)).applications
    assert "lora_modules" not in plain.args and "allow_runtime_lora_updating" not in plain.args
    values = {
        "lora": {"modules": {"sql": "/adapters/sql"}, "allowRuntimeUpdating": True},
        "engine": {"lora": {"max_loras": 2}},
    }
    (app,) = serve_config(render(chart, values)).applications
    args = ServeAppArgs.model_validate(app.args)
    assert [(m.name, m.path) for m in args.lora_modules] == [("sql", "/adapters/sql")]
    assert args.allow_runtime_lora_updating
    lora = args.engine_config().lora
    assert (lora.enable_lora, lora.max_loras) == (True, 2)


def test_pods_outlive_the_replicas_shutdown_grace_period(chart: Any) -> None:
    objects = render(chart)
    (app,) = serve_config(objects).applications
    ingress, engine = app.deployments
    assert engine.graceful_shutdown_timeout_s == 25
    assert ingress.graceful_shutdown_timeout_s == 30  # outlives the engines
    assert engine.health_check_period_s == 2  # a replica with a dead engine goes in ~6 s
    assert app.args["shutdown"] == {"grace_s": 25}
    cluster = objects["RayService"]["spec"]["rayClusterConfig"]
    (group,) = cluster["workerGroupSpecs"]
    for pod in (cluster["headGroupSpec"]["template"]["spec"], group["template"]["spec"]):
        assert pod["terminationGracePeriodSeconds"] == 40
    with pytest.raises(helm.HelmRenderError, match="terminationGracePeriodSeconds must exceed"):
        render(chart, {"serve": {"shutdownGraceS": 36}})
