"""The Ray Serve application: an `OpenAIIngress` deployment in front of a `GenerationServer`
(engine) deployment, the shape Ray Serve's LLM apps use.

`serve run cluster/serving/serve_config.yaml` builds it through `build_app(args)`; `args` is
`ServeAppArgs`, whose engine section is `cluster.engine.config.EngineConfig`. The ingress takes
HTTP, gRPC and handle calls, renders and hashes each prompt once, and calls the engine
deployment through a handle that `PrefixAwareRouter` routes by prefix; each engine replica owns
one engine. The two deployments scale independently (each has its own `deployments` entry in
the Serve config).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ray import serve

from cluster.serving.app_args import ServeAppArgs
from cluster.serving.engine_server import DEPLOYMENT_NAME, GenerationServer
from cluster.serving.ingress import INGRESS_NAME, OpenAIIngress

__all__ = ["DEPLOYMENT_NAME", "INGRESS_NAME", "bind_app", "build_app"]


def bind_app(
    args: Mapping[str, Any],
    *,
    engine_options: Mapping[str, Any] | None = None,
    ingress_options: Mapping[str, Any] | None = None,
) -> serve.Application:
    """The application graph for validated `args`, with Serve deployment options for the engine
    and the ingress (e.g. `num_replicas`, `ray_actor_options`) where a caller sets them."""
    engine = GenerationServer.options(**dict(engine_options or {})).bind(dict(args))
    return OpenAIIngress.options(**dict(ingress_options or {})).bind(engine, dict(args))


def build_app(args: dict[str, Any]) -> serve.Application:
    """The Serve application builder named by `import_path` in the Serve config; validates the
    arguments (the engine config included, and its parallelism against the model's heads)
    before any replica starts."""
    validated = ServeAppArgs.model_validate(args)
    validated.engine_config().check_model()
    return bind_app(validated.model_dump())
