"""Where a `WorkerGroup`'s rank actors go: into the caller's placement group when it runs in one
(a Serve replica started with `placement_group_bundles`), else into a group of their own.

A Serve replica's group (see the Helm chart) holds the replica actor's bundle first, then one
bundle per tensor-parallel rank (`{"CPU": c, "GPU": 1}` on GPUs); it is STRICT_PACK, so every
rank lands on the replica's node. Creating a second group there would ask the cluster for the
GPUs again (2 x TP per replica), which is what this module avoids: the ranks take the last
`world_size` bundles of the replica's group, one each, with exactly the resources those bundles
hold. Without a current group, the group creates one STRICT_PACK group (one bundle per rank, on
one node) and removes it at shutdown.

Invariants: rank `r` is scheduled into bundle `bundle_indices[r]` of `placement_group`, and no
two ranks share a bundle; a rank asks for a GPU only when its bundle holds one; only a group
this module created (`owned`) is removed by its user.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PLACEMENT_TIMEOUT_S = 120.0
"""How long to wait for the Ray cluster to fit one bundle per rank before failing."""


@dataclass(frozen=True)
class RankPlacement:
    """The placement group, and per rank: its bundle index, CPUs, GPUs and torch device."""

    placement_group: Any
    owned: bool
    bundle_indices: list[int]
    num_cpus: list[float]
    num_gpus: list[float]
    devices: list[str]


def rank_device(preference: str, has_gpu: bool) -> str:
    """Where a rank computes: `preference` ("cpu" or "cuda"), or for "auto" CUDA exactly when
    the rank has a GPU."""
    if preference == "auto":
        return "cuda" if has_gpu else "cpu"
    return preference


def local_device(preference: str) -> str:
    """`rank_device` for a rank in this process: it has a GPU when torch sees one here."""
    import torch

    return rank_device(preference, torch.cuda.is_available())


def place_ranks(world_size: int, device: str = "auto") -> RankPlacement:
    """Bundles for `world_size` ranks (see the module doc); `device` overrides where they
    compute ("cpu" keeps them on the CPU even in GPU bundles: simulated clusters, tests)."""
    from ray.util import get_current_placement_group

    current = get_current_placement_group()
    if current is not None:
        return _in_replica_group(current, world_size, device)
    return _own_group(world_size, device)


def _in_replica_group(group: Any, world_size: int, device: str) -> RankPlacement:
    bundles: list[dict[str, float]] = list(group.bundle_specs)
    if len(bundles) < world_size + 1:
        raise ValueError(
            f"the replica's placement group has {len(bundles)} bundles; {world_size} "
            f"tensor-parallel ranks need {world_size + 1}: the replica's own bundle first, then "
            "one per rank (placement_group_bundles in the Serve config)"
        )
    indices = list(range(len(bundles) - world_size, len(bundles)))
    chosen = [bundles[i] for i in indices]
    gpus = [1.0 if b.get("GPU", 0) >= 1 else 0.0 for b in chosen]
    return RankPlacement(
        placement_group=group,
        owned=False,
        bundle_indices=indices,
        num_cpus=[min(1.0, float(b.get("CPU", 0))) for b in chosen],
        num_gpus=gpus,
        devices=[rank_device(device, gpu > 0) for gpu in gpus],
    )


def _own_group(world_size: int, device: str) -> RankPlacement:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    use_gpu = device != "cpu" and ray.cluster_resources().get("GPU", 0) >= world_size
    bundle = {"CPU": 1.0, "GPU": 1.0} if use_gpu else {"CPU": 1.0}
    group = placement_group([dict(bundle) for _ in range(world_size)], "STRICT_PACK")
    try:
        ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError as error:
        remove_placement_group(group)
        raise ValueError(
            f"could not place {world_size} worker ranks of {bundle} each on one node within "
            f"{PLACEMENT_TIMEOUT_S} s; the Ray cluster has {ray.available_resources()}"
        ) from error
    gpu = 1.0 if use_gpu else 0.0
    return RankPlacement(
        placement_group=group,
        owned=True,
        bundle_indices=list(range(world_size)),
        num_cpus=[1.0] * world_size,
        num_gpus=[gpu] * world_size,
        devices=[rank_device(device, use_gpu)] * world_size,
    )
