"""`WorkerGroup`: all tensor-parallel ranks of one model, driven as one.

Backend "ray": one Ray actor per rank, joined in a torch.distributed group, each in a bundle of
its own: the caller's placement group's when it runs in one (a Serve replica), else a group the
WorkerGroup creates and removes (see `workers.placement`).
Backend "local": one in-process rank (TP = 1), for tests, offline use and CPU serving; its
load, steps and shutdown run on the rank's one thread (`workers.rank_thread`: OpenMP teams of
several calling threads fight for the cores). Adapter files are read on a second thread with
one torch thread (no OpenMP team), so a load overlaps the steps instead of stalling them.

Every step sends the same plan to every rank (one `ray.put` when there are several, so it is
serialized once); rank 0's `StepOutput` comes back. Async scheduling's placeholder tokens
are filled here, from the previous plan's output, before a plan goes to the ranks
(`workers.placeholders`). The group keeps the last and mean per-step
call overhead: round-trip wall time minus the time rank 0 spent executing the step.
"""

from __future__ import annotations

import asyncio
import pathlib
import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from pagedserve_kernels import kv_quant
from workers.block_io import BlockShard
from workers.config import ModelInfo, ModelSpec, WorkerConfig
from workers.cpu_features import CpuFeatures, auto_dtype, auto_quantized_activations
from workers.kv_memory import KVShape
from workers.loader import ModelDescription, describe_model, read_metadata
from workers.lora import AdapterSummary
from workers.model_source import resolve_model_path
from workers.parallel import check_tensor_parallel
from workers.placeholders import PlaceholderFiller
from workers.placement import RankPlacement, local_device, place_ranks
from workers.plan import StepOutput, StepPlan
from workers.rank import WorkerRank
from workers.rank_results import gather, gather_async
from workers.rank_thread import RankThread
from workers.weights_digest import default_cache_root

SHUTDOWN_TIMEOUT_S = 30.0
"""How long ranks get to leave the process group cleanly before they are killed."""


@dataclass
class CallOverhead:
    """Per-step call overhead (seconds): round trip minus rank 0's own execution time."""

    last: float = 0.0
    total: float = 0.0
    steps: int = 0

    def record(self, round_trip: float, on_rank: float) -> None:
        self.last = max(0.0, round_trip - on_rank)
        self.total += self.last
        self.steps += 1

    @property
    def mean(self) -> float:
        return self.total / self.steps if self.steps else 0.0


def _max_model_len(config: WorkerConfig, spec: ModelSpec) -> int:
    limit = spec.max_position_embeddings
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        raise ValueError(
            f"max_model_len {config.max_model_len} exceeds the model's context length {limit}"
        )
    return config.max_model_len


def _model_info(
    config: WorkerConfig, description: ModelDescription, max_model_len: int, device: str
) -> ModelInfo:
    spec = description.spec
    kv_dtype = config.kv_storage_dtype(torch.device(device))
    groups = config.kv_group_layout(spec.layer_sliding_windows)
    full_shape = KVShape(
        groups.slots, config.block_size, spec.num_kv_heads, spec.head_dim, kv_dtype
    )
    return ModelInfo(
        architecture=spec.architecture,
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        vocab_size=spec.vocab_size,
        max_model_len=max_model_len,
        sliding_window=spec.sliding_window,
        bos_token_id=spec.bos_token_id,
        eos_token_ids=spec.eos_token_ids,
        weights_digest=description.weights_digest,
        dtype=config.dtype,
        rope=spec.rope.canonical(),
        quantization=description.quantization,
        kv_bytes_per_block=full_shape.bytes_per_block,
        kv_cache_dtype=kv_quant.canonical(config.kv_cache_dtype),
        quantized_activations=bool(config.quantized_activations),
        kv_group_windows=groups.windows if groups.hybrid else (),
    )


def resolve_auto(config: WorkerConfig, device: str) -> WorkerConfig:
    """`config` with `dtype` and `quantized_activations` concrete for the ranks' `device`:
    `auto` resolved by the CPU rule (`workers.cpu_features`); `quantized_activations: auto`
    is on only where `dtype` was `auto` too (a dtype given is a precision asked for)."""
    if config.dtype != "auto":
        quantized = config.quantized_activations is True
        return replace(config, quantized_activations=quantized)
    cpu = CpuFeatures.detect() if device == "cpu" else None  # read once for both choices
    quantized = config.quantized_activations
    if quantized == "auto":
        quantized = auto_quantized_activations(device, cpu)
    return replace(config, dtype=auto_dtype(device, cpu), quantized_activations=quantized)


class WorkerGroup:
    """Loads the model on every rank, allocates the KV pools, and executes one plan per step."""

    def __init__(self, config: WorkerConfig) -> None:
        cache_root = pathlib.Path(config.weights_cache_dir or default_cache_root())
        path = resolve_model_path(config.model)
        metadata = read_metadata(path)  # refusals from the metadata first: no weights read
        spec = metadata.spec
        check_tensor_parallel(spec, config.tensor_parallel_size, config.enable_expert_parallel)
        max_model_len = _max_model_len(config, spec)
        description = describe_model(path, cache_root, metadata)
        self.overhead = CallOverhead()
        self._placeholders = PlaceholderFiller()
        self._ray_order = asyncio.Lock()
        """Ray: one plan at a time from `execute_async`, each filled after the previous ran."""
        self._local: WorkerRank | None = None
        # Local backend only (a RankThread starts its thread on first use). The rank thread
        # starts with the builder's torch thread count (OpenMP keeps one per thread); the rank
        # sets `num_threads` on it when the config asks for a count.
        threads = torch.get_num_threads()
        self._rank_thread = RankThread(initializer=lambda: torch.set_num_threads(threads))
        self._loader_thread = RankThread(
            "pagedserve-rank0-loader", initializer=lambda: torch.set_num_threads(1)
        )
        self._actors: list[Any] = []
        self.placement: RankPlacement | None = None
        if config.backend == "local":
            device = local_device(config.device)
        else:
            import ray

            if not ray.is_initialized():
                ray.init(include_dashboard=False)
            self.placement = place_ranks(config.tensor_parallel_size, config.device)
            device = self.placement.devices[0]
        config = resolve_auto(config, device)
        self.config = config
        self.model_info = _model_info(config, description, max_model_len, device)
        args = (config, description, str(cache_root))
        try:
            if config.backend == "local":
                thread = self._rank_thread
                self._local = local = thread.call(WorkerRank, *args, 0, 1, device, max_model_len)
                thread.call(local.load)
                self.num_device_blocks = thread.call(local.measure_device_blocks)
                self.num_cpu_blocks = thread.call(local.cpu_blocks)
                thread.call(local.allocate, self.num_device_blocks, self.num_cpu_blocks)
            else:
                self._start_actors(args, max_model_len)
        except BaseException:
            self.shutdown()  # no actor or placement group outlives a failed start
            raise

    def _start_actors(self, args: tuple[Any, ...], max_model_len: int) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        world = self.config.tensor_parallel_size
        placement = self.placement
        assert placement is not None
        actor_class = ray.remote(WorkerRank)
        for rank in range(world):
            strategy = PlacementGroupSchedulingStrategy(
                placement.placement_group, placement.bundle_indices[rank]
            )
            options = actor_class.options(
                num_cpus=placement.num_cpus[rank],
                num_gpus=placement.num_gpus[rank],
                scheduling_strategy=strategy,
            )
            device = placement.devices[rank]
            self._actors.append(options.remote(*args, rank, world, device, max_model_len))
        host, port = ray.get(self._actors[0].rendezvous_address.remote())
        ray.get([actor.init_distributed.remote(host, port) for actor in self._actors])
        ray.get([actor.load.remote() for actor in self._actors])
        self.num_device_blocks = min(
            ray.get([actor.measure_device_blocks.remote() for actor in self._actors])
        )
        self.num_cpu_blocks = min(ray.get([actor.cpu_blocks.remote() for actor in self._actors]))
        ray.get(
            [
                actor.allocate.remote(self.num_device_blocks, self.num_cpu_blocks)
                for actor in self._actors
            ]
        )

    @property
    def local_rank(self) -> WorkerRank | None:
        """The in-process rank (backend "local"), for tools that observe its steps from
        outside (the layouts benchmark); None for Ray actors. Read it only between steps."""
        return self._local

    def rank_nodes(self) -> list[str]:
        """The Ray node id of every rank actor, in rank order (empty for the local backend)."""
        if not self._actors:
            return []
        import ray

        return ray.get([actor.node_id.remote() for actor in self._actors])

    def add_lora(self, path: str) -> AdapterSummary:
        """Every rank reads its slice of the PEFT adapter at `path` into CPU memory (blocking;
        in process on the loader thread, while steps go on; on Ray, queued behind the step each
        rank is running). Raises ValueError naming the
        problem, on every rank alike (the same validation), with nothing loaded changed."""
        if self._local is not None:
            return self._loader_thread.call(self._local.add_lora, path)
        import ray

        try:
            summaries = ray.get([actor.add_lora.remote(path) for actor in self._actors])
        except ray.exceptions.RayTaskError as error:
            if isinstance(error.cause, ValueError):
                raise ValueError(str(error.cause)) from None
            raise
        digests = {summary.digest for summary in summaries}
        if len(digests) != 1:
            raise ValueError(f"adapter {path!r}: the ranks read different weights ({digests})")
        return summaries[0]

    def execute(self, plan: StepPlan) -> StepOutput:
        """Run one step on every rank (blocking); returns rank 0's output."""
        output, _ = self.execute_with_logits(plan, keep_logits=False)
        return output

    def execute_with_logits(
        self, plan: StepPlan, keep_logits: bool = True
    ) -> tuple[StepOutput, torch.Tensor | None]:
        """`execute`, plus rank 0's float32 logits of the sampled rows (for tests and tools)."""
        began = time.perf_counter()
        if self._local is not None:
            output, logits = self._rank_thread.call(self._run_local, plan, keep_logits)
        else:

            def run_on_ranks(filled: StepPlan) -> tuple[StepOutput | None, torch.Tensor | None]:
                plan_ref = self._shared(filled)
                refs = [a.execute_with_logits.remote(plan_ref, keep_logits) for a in self._actors]
                return gather(refs)[0]

            output, logits = self._placeholders.run(plan, run_on_ranks)
        assert output is not None
        self.overhead.record(time.perf_counter() - began, output.forward_seconds)
        return output, logits

    async def execute_async(self, plan: StepPlan) -> StepOutput:
        """`execute`, awaitable: the event loop keeps running while the ranks work. Plans run
        in the order of the calls, each after the previous one ended (its placeholders are
        filled from that one's output)."""
        began = time.perf_counter()
        if self._local is not None:
            output, _ = await self._rank_thread.call_async(self._run_local, plan, False)
        else:

            async def run_on_ranks(filled: StepPlan) -> tuple[StepOutput | None, None]:
                plan_ref = self._shared(filled)
                outputs = await gather_async([a.execute.remote(plan_ref) for a in self._actors])
                return outputs[0], None

            async with self._ray_order:
                output, _ = await self._placeholders.run_async(plan, run_on_ranks)
        assert output is not None
        self.overhead.record(time.perf_counter() - began, output.forward_seconds)
        return output

    def _run_local(
        self, plan: StepPlan, keep_logits: bool
    ) -> tuple[StepOutput | None, torch.Tensor | None]:
        """One plan on the in-process rank, on its thread (so plans run one after the other in
        the order they were handed over), its placeholders filled from the previous output."""
        local = self._local
        assert local is not None
        return self._placeholders.run(
            plan, lambda filled: local.execute_with_logits(filled, keep_logits)
        )

    def _shared(self, plan: StepPlan) -> Any:
        """What the rank actors are sent: one `ray.put` of the plan when there are several (it
        is serialized once), the plan itself for one."""
        import ray

        return ray.put(plan) if len(self._actors) > 1 else plan

    async def read_blocks_async(self, sources: list[tuple[str, int]]) -> list[BlockShard]:
        """Every rank's `BlockShard` of the (tier, block) `sources`, in rank order; each rank
        reads only its own KV heads, between its steps."""
        if self._local is not None:
            return [await self._rank_thread.call_async(self._local.read_blocks, sources)]
        return list(await asyncio.gather(*[a.read_blocks.remote(sources) for a in self._actors]))

    async def write_blocks_async(self, blocks: list[int], shards: list[BlockShard]) -> int:
        """Rank i writes `shards[i]` into device `blocks`; returns how many leading blocks every
        rank verified and wrote (blocks past it must not be used)."""
        if len(shards) != self.config.tensor_parallel_size:
            raise ValueError(
                f"{len(shards)} shards for {self.config.tensor_parallel_size} ranks (the peer "
                "runs another tensor-parallel split)"
            )
        if self._local is not None:
            return await self._rank_thread.call_async(self._local.write_blocks, blocks, shards[0])
        written = await asyncio.gather(
            *[a.write_blocks.remote(blocks, s) for a, s in zip(self._actors, shards, strict=True)]
        )
        return min(written)

    def shutdown(self) -> None:
        """Stop every rank and release the placement group (idempotent)."""
        self._loader_thread.close()  # an adapter read in flight finishes first
        if self._local is not None:
            self._rank_thread.call(self._local.shutdown)
            self._local = None
        self._rank_thread.close()
        if self._actors:
            import ray

            try:
                ray.get([a.shutdown.remote() for a in self._actors], timeout=SHUTDOWN_TIMEOUT_S)
            except (ray.exceptions.RayError, ValueError):
                pass  # a rank that failed or hangs is killed below either way
            finally:
                for actor in self._actors:
                    ray.kill(actor)
                self._actors = []
        if self.placement is not None:
            if self.placement.owned:  # a replica's own group is Serve's to remove
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(self.placement.placement_group)
            self.placement = None
