"""`pagedserve serve --pd`: a colocated Serve config turned into a disaggregated one.

Each application built by `cluster.serving.serve_app:build_app` is built by
`cluster.serving.pd_app:build_pd_app` instead, and its engine deployment's entry
(`GenerationServer`) becomes two with the same options, `Prefill` and `Decode`, so each can be
scaled (or pinned by `--replicas`) on its own. The args gain empty `prefill` and `decode`
sections unless the config has them already; everything else is kept.
"""

from __future__ import annotations

import copy
from typing import Any

from cluster.serving.app_args import DEPLOYMENT_NAME
from cluster.serving.pd_args import DECODE_DEPLOYMENT, PREFILL_DEPLOYMENT

COLOCATED_BUILDER = "cluster.serving.serve_app:build_app"
PD_BUILDER = "cluster.serving.pd_app:build_pd_app"
ENGINE_DEPLOYMENTS = frozenset({DEPLOYMENT_NAME, PREFILL_DEPLOYMENT, DECODE_DEPLOYMENT})
"""The names an engine deployment has in a colocated or a disaggregated application."""


def disaggregated(config: dict[str, Any]) -> dict[str, Any]:
    """A copy of `config` with every colocated application disaggregated (see the module doc);
    applications with another builder are left as they are."""
    result = copy.deepcopy(config)
    for app in result.get("applications", []):
        if app.get("import_path") != COLOCATED_BUILDER:
            continue
        app["import_path"] = PD_BUILDER
        args = app.setdefault("args", {})
        args.setdefault("prefill", {})
        args.setdefault("decode", {})
        deployments = []
        for deployment in app.get("deployments", []):
            if deployment.get("name") != DEPLOYMENT_NAME:
                deployments.append(deployment)
                continue
            for name in (PREFILL_DEPLOYMENT, DECODE_DEPLOYMENT):
                side = copy.deepcopy(deployment)
                side["name"] = name
                if name == DECODE_DEPLOYMENT:
                    side.pop("request_router_config", None)  # the builder sets its own
                deployments.append(side)
        app["deployments"] = deployments
    return result
