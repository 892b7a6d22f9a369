"""The prefill/decode disaggregated Serve application, in Ray Serve LLM's shape
(`build_pd_openai_app`): an `OpenAIIngress` (the proxy) in front of a `Prefill` and a `Decode`
engine deployment.

Both deployments are `GenerationServer`s on the same model and cache identity (`PDAppArgs`);
they differ in their engine settings, their Serve options and their router: the prefill
deployment keeps `PrefixAwareRouter` (a prompt goes where its prefix is cached), the decode
deployment `KVPressureRouter` (a resumed request goes where KV blocks are free). The ingress
sends each request through a `DisaggregatedClient` (cluster/serving/pd_client.py): a
prefill-only call, then a decode call that pulls the prompt's blocks from the prefill replica
(the hint names the prefill deployment and replica; prefill replicas only export).
`serve run` names `cluster.serving.pd_app:build_pd_app` as `import_path`; `pagedserve serve
--pd` builds that config from the shipped one.
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from cluster.serving.engine_server import ROUTING_STATS_PERIOD_S, GenerationServer
from cluster.serving.ingress import OpenAIIngress
from cluster.serving.pd_args import DECODE_DEPLOYMENT, PREFILL_DEPLOYMENT, PDAppArgs
from cluster.serving.pd_routing import DECODE_ROUTER_CLASS_PATH

__all__ = ["DECODE_DEPLOYMENT", "PREFILL_DEPLOYMENT", "bind_pd_app", "build_pd_app"]


def bind_pd_app(args: PDAppArgs) -> serve.Application:
    """The application graph for validated `args`."""
    prefill_args = args.role_args("prefill")
    decode_args = args.role_args("decode")
    prefill_args.kv_transfer.pull = False  # it computes; it only exports
    decode_options: dict[str, Any] = {
        "request_router_config": RequestRouterConfig(
            request_router_class=DECODE_ROUTER_CLASS_PATH,
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
        ),
        **args.decode.deployment,
    }
    prefill = GenerationServer.options(name=PREFILL_DEPLOYMENT, **args.prefill.deployment).bind(
        prefill_args.model_dump()
    )
    decode = GenerationServer.options(name=DECODE_DEPLOYMENT, **decode_options).bind(
        decode_args.model_dump()
    )
    return OpenAIIngress.bind(prefill, prefill_args.model_dump(), decode)


def build_pd_app(args: dict[str, Any]) -> serve.Application:
    """The Serve application builder named by `import_path`; validates both sides (the same
    model and cache identity, each engine against the model) before any replica starts."""
    validated = PDAppArgs.model_validate(args)
    validated.check()
    return bind_pd_app(validated)
