"""The `args` of a prefill/decode disaggregated application (pydantic at the edge).

`PDAppArgs` is `ServeAppArgs` plus a `prefill` and a `decode` section (`PDRoleArgs`), each with
the engine settings that differ for that deployment (merged over the shared `engine` section:
e.g. a larger `max_num_batched_tokens` for prefill, more `max_num_seqs` for decode) and the
deployment's Serve options (`num_replicas` or `autoscaling_config`, `max_ongoing_requests`,
`ray_actor_options`), so the two scale independently. A Serve config's `deployments` entry
named `Prefill` or `Decode` still overrides those options, as for any deployment.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from cluster.serving.app_args import ServeAppArgs

PREFILL_DEPLOYMENT = "Prefill"
DECODE_DEPLOYMENT = "Decode"
Role = Literal["prefill", "decode"]

DEPLOYMENT_OPTIONS = frozenset(
    {
        "num_replicas",
        "autoscaling_config",
        "max_ongoing_requests",
        "max_queued_requests",
        "ray_actor_options",
        "health_check_period_s",
        "health_check_timeout_s",
        "graceful_shutdown_timeout_s",
        "graceful_shutdown_wait_loop_s",
        "placement_group_bundles",
        "placement_group_strategy",
        "request_router_config",
    }
)
"""The Serve deployment options a role section may set."""
SHARED_CACHE_FIELDS = {"block_size", "kv_layout", "enable_prefix_caching"}
"""What decides the blocks' identity and layout: the two sides must agree on it."""


def merged(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """`base` with `overrides` applied section by section (nested mappings merge, the rest is
    replaced)."""
    result = dict(base)
    for key, value in overrides.items():
        current = result.get(key)
        if isinstance(current, Mapping) and isinstance(value, Mapping):
            result[key] = merged(current, value)
        else:
            result[key] = value
    return result


class PDRoleArgs(BaseModel):
    """One side of the disaggregated application: its engine overrides and Serve options."""

    model_config = ConfigDict(extra="forbid")

    engine: dict[str, Any] = Field(
        default_factory=dict,
        description="cluster.engine.config.EngineConfig sections merged over the app's engine",
    )
    deployment: dict[str, Any] = Field(
        default_factory=dict,
        description="Serve deployment options (num_replicas or autoscaling_config, ...)",
    )

    @model_validator(mode="after")
    def _known_options(self) -> PDRoleArgs:
        unknown = sorted(set(self.deployment) - DEPLOYMENT_OPTIONS)
        if unknown:
            raise ValueError(
                f"deployment: unknown Serve option(s) {unknown}; allowed: "
                f"{sorted(DEPLOYMENT_OPTIONS)}"
            )
        if {"num_replicas", "autoscaling_config"} <= set(self.deployment):
            raise ValueError("deployment: set num_replicas or autoscaling_config, not both")
        return self


class PDAppArgs(ServeAppArgs):
    """`ServeAppArgs` with the `prefill` and `decode` sections (see the module doc)."""

    prefill: PDRoleArgs = Field(default_factory=PDRoleArgs)
    decode: PDRoleArgs = Field(default_factory=PDRoleArgs)

    def role_args(self, role: Role) -> ServeAppArgs:
        """What one engine deployment (or the ingress, for `prefill`) runs with: the shared
        arguments, the role's engine merged over the shared engine section."""
        shared = self.model_dump(exclude={"prefill", "decode"})
        section: PDRoleArgs = getattr(self, role)
        shared["engine"] = merged(self.engine, section.engine)
        return ServeAppArgs.model_validate(shared)

    def check(self) -> None:
        """Both engines valid, and the same model with the same cache identity: the decode
        side continues what the prefill side computed (raises ConfigError otherwise)."""
        from cluster.engine.errors import ConfigError

        prefill = self.role_args("prefill").engine_config()
        decode = self.role_args("decode").engine_config()
        for config in (prefill, decode):
            config.check_model()
        shared = {
            "model": prefill.model.model_dump(),
            "cache": prefill.cache.model_dump(include=SHARED_CACHE_FIELDS),
        }
        theirs = {
            "model": decode.model.model_dump(),
            "cache": decode.cache.model_dump(include=SHARED_CACHE_FIELDS),
        }
        for section, mine in shared.items():
            if mine != theirs[section]:
                raise ConfigError(
                    f"prefill and decode must share engine.{section} "
                    f"(prefill: {mine}, decode: {theirs[section]})"
                )
