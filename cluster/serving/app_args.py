"""The `args` of the Serve application, validated when the app is built (pydantic at the edge).

`engine` is `cluster.engine.config.EngineConfig` as a mapping, validated by `engine_config()`.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from cluster.engine.config import EngineConfig
from cluster.serving.limits import LimitsArgs


class DirectoryArgs(BaseModel):
    """The KV directory: the application's cluster-wide prefix index (kv_directory.py)."""

    model_config = ConfigDict(extra="forbid")

    max_entries: int = Field(
        1_000_000, ge=1, description="block hashes indexed at most (least recently used go first)"
    )
    publish_period_s: float = Field(
        0.05, gt=0, le=10, description="how often an engine replica sends its block events"
    )
    replica_timeout_s: float = Field(
        10.0, gt=0, description="a replica silent this long is dropped with its entries"
    )
    query_timeout_s: float = Field(
        0.25, gt=0, description="a routing query slower than this answers nothing (load only)"
    )


class HealthArgs(BaseModel):
    """When a replica reports itself unhealthy."""

    model_config = ConfigDict(extra="forbid")

    stuck_after_s: float = Field(
        60.0, gt=0, description="an engine with work whose step count has not moved this long"
    )


DEFAULT_SHUTDOWN_GRACE_S = 25.0
"""Kubernetes' default termination grace period (30 s) less a margin for stopping Serve and Ray:
a pod's `terminationGracePeriodSeconds` must exceed the grace period (helm/pagedserve)."""


class ShutdownArgs(BaseModel):
    """What `pagedserve serve` does on SIGINT/SIGTERM (cluster/serving/serve_runner.py)."""

    model_config = ConfigDict(extra="forbid")

    grace_s: float = Field(
        DEFAULT_SHUTDOWN_GRACE_S,
        ge=0,
        le=3600,
        description="seconds in-flight requests may run on after the signal before they end "
        "with an error event (new requests are refused at once)",
    )


class ServeAppArgs(BaseModel):
    """The `args` of the Serve application (validated when the app is built)."""

    model_config = ConfigDict(extra="forbid")

    served_model_name: str = Field("SmolLM2-135M-Instruct", min_length=1)
    engine: dict[str, Any] = Field(
        default_factory=dict, description="cluster.engine.config.EngineConfig"
    )
    api_keys: dict[str, str] = Field(
        default_factory=dict,
        description="API key -> tenant name; empty: no authentication and one shared tenant",
    )

    directory: DirectoryArgs = Field(default_factory=DirectoryArgs)
    health: HealthArgs = Field(default_factory=HealthArgs)
    limits: LimitsArgs = Field(default_factory=LimitsArgs)
    shutdown: ShutdownArgs = Field(default_factory=ShutdownArgs)
    shared_prefixes: list[Annotated[str, Field(min_length=1)]] = Field(
        default_factory=list,
        description=(
            "operator-chosen prompt prefixes (e.g. a system prompt, as the rendered prompt "
            "begins) whose whole KV blocks all tenants share; blocks after them stay per tenant"
        ),
    )

    def engine_config(self) -> EngineConfig:
        return EngineConfig.build(self.engine)
