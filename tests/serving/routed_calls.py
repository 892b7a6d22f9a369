"""Calls through an application's engine deployment exactly as its ingress admits them, from the
test process: the same `FrontEnd.submit` (rendered once, block hashes carried on the request)
over the same `RoutedEngineClient` and KV directory client, so `PrefixAwareRouter` routes them;
each answer comes back with the replica that served it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cluster.engine.generate_request import RequestBuilder
from cluster.engine.output_stream import OutputAccumulator
from cluster.engine.outputs import RequestOutput
from cluster.engine.sampling_params import SamplingParams
from cluster.engine.tokenization import PromptRenderer
from cluster.serving.frontend import FrontEnd
from cluster.serving.kv_directory import DirectoryClient, directory_handle
from cluster.serving.lora_admin import AdapterService
from cluster.serving.routed_engine import RoutedEngineClient

SERVED_MODEL = "tiny"


@dataclass(frozen=True)
class RoutedOutput:
    """A whole answer with the engine replica that produced it."""

    replica_id: str
    output: RequestOutput


class RoutedClient:
    """The ingress's admission path over the engine deployment of an application (build it
    with `await RoutedClient.connect(app_name)`)."""

    def __init__(self, app_name: str, engine: Any, description: Any) -> None:
        from cluster.serving.app_args import DirectoryArgs

        info = description.model_info
        builder = RequestBuilder(
            PromptRenderer(description.tokenizer, info.vocab_size), description.block_size
        )
        settings = DirectoryArgs()
        directory = DirectoryClient(
            directory_handle(app_name, settings.max_entries, settings.replica_timeout_s),
            settings.query_timeout_s,
        )
        client = RoutedEngineClient(engine, directory.holdings)
        adapters = AdapterService(SERVED_MODEL, None)
        self.frontend = FrontEnd(
            builder,
            info.max_model_len,
            client,
            adapters,
            description.keys,
            generation_defaults=description.generation_defaults,
        )
        self._ids = 0

    @classmethod
    async def connect(cls, app_name: str) -> RoutedClient:
        from ray import serve

        from cluster.serving.serve_app import DEPLOYMENT_NAME

        engine = serve.get_deployment_handle(DEPLOYMENT_NAME, app_name=app_name)
        return cls(app_name, engine, await engine.describe.remote())

    async def generate(
        self, prompt: str | Mapping[str, Any], params: SamplingParams
    ) -> RoutedOutput:
        self._ids += 1
        submission = await self.frontend.submit(
            [prompt],
            params,
            model=SERVED_MODEL,
            request_id=f"test-{id(self)}-{self._ids}",
            tenant_salt=None,
        )
        (stream,) = submission.streams
        accumulator = OutputAccumulator()
        output = None
        async for delta in stream:
            output = accumulator.apply(delta)
        assert output is not None
        return RoutedOutput(submission.served_by or "", output)
