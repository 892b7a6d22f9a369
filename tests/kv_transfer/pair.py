"""Two tiny-Llama `AsyncEngine`s in one process joined by an `InProcessTransport`: a holder
that computes prompts and a receiver that pulls their prefixes (the shared pieces of the
transfer tests)."""

from __future__ import annotations

import pathlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cluster.engine.async_engine import AsyncEngine
from cluster.engine.generate_request import GenerateRequest
from cluster.engine.outputs import RequestOutput
from cluster.engine.sampling_params import SamplingParams
from cluster.kv_transfer.cost_model import TransferCostModel
from cluster.kv_transfer.hint import KVSourceHint
from cluster.kv_transfer.puller import PullSettings
from cluster.kv_transfer.service import KVTransferService
from cluster.kv_transfer.transport import InProcessTransport
from tests.engine.streams import engine_outputs
from tests.engine.tiny_engine import tiny_config

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
LONG_PROMPT = " ".join(f"word{i} of the paged cache" for i in range(24))


class HeldLocator:
    """Answers like the KV directory, from the engines' own block managers."""

    def __init__(self, engines: dict[str, AsyncEngine]) -> None:
        self.engines = engines

    async def holdings(self, chain: list[bytes]) -> dict[str, int]:
        held = {}
        for name, engine in self.engines.items():
            tiers = engine.core.block_manager.cached_hashes_by_tier()
            have = {digest for hashes in tiers.values() for digest in hashes}
            count = 0
            for digest in chain:
                if digest not in have:
                    break
                count += 1
            if count:
                held[name] = count
        return held


@dataclass
class EnginePair:
    holder: AsyncEngine
    receiver: AsyncEngine
    transport: InProcessTransport
    services: dict[str, KVTransferService]

    def request(self, prompt: str, **fields: Any) -> GenerateRequest:
        return self.receiver.request_builder.build(prompt, GREEDY, **fields)

    def hint_for(self, request: GenerateRequest) -> KVSourceHint:
        hashes = self.holder.core.request_keys.block_hashes(request)
        return KVSourceHint("holder", tuple(hashes))

    async def shutdown(self) -> None:
        await self.holder.shutdown()
        await self.receiver.shutdown()


def build_pair(
    model_dir: pathlib.Path,
    settings: PullSettings | None = None,
    cost: TransferCostModel | None = None,
    **cache: Any,
) -> EnginePair:
    config = tiny_config(model_dir, cache={"block_size": 8, "num_device_blocks": 64, **cache})
    holder, receiver = AsyncEngine(config), AsyncEngine(config)
    transport = InProcessTransport()
    engines = {"holder": holder, "receiver": receiver}
    locator = HeldLocator(engines)
    services = {}
    for name, engine in engines.items():
        service = KVTransferService(
            name,
            engine.core,
            transport,
            locator,
            settings or PullSettings(timeout_s=5.0, use_cost_model=False),
            cost,
        )
        engine.attach_kv_transfer(service)
        transport.register(name, service.export_blocks)
        services[name] = service
    return EnginePair(holder, receiver, transport, services)


async def final_output(engine: AsyncEngine, request: GenerateRequest) -> RequestOutput:
    outputs = [o async for o in engine_outputs(engine, request)]
    return outputs[-1]


def tokens(outputs: Sequence[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def assert_no_pins(*engines: AsyncEngine) -> None:
    """No transfer lease is left and every block manager invariant holds."""
    for engine in engines:
        bm = engine.core.block_manager
        assert bm.transfer_leases.active() == []
        bm.check_integrity()
