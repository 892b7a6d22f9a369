"""A real local Ray cluster running the Serve app with the tiny model, shared by the serving tests,
the session's one two-replica app beside it (`tests/serving/two_replicas.py`), and an
independent oracle: HF transformers with the same weights, decoding greedily."""

from __future__ import annotations

import pathlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import torch
import transformers
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.ports import free_port
from tests.serving import two_replicas
from tests.serving.two_replicas import TwoReplicaApp

API_KEYS = {"key-alice": "alice", "key-alice-2": "alice", "key-bob": "bob"}
MODEL = "tiny"
MAX_MODEL_LEN = 512
SHARED_SYSTEM_PROMPT = "Operator system prompt: you are a careful assistant for paged memory. "
"""Declared in the session app's `shared_prefixes`: tenants share its whole KV blocks."""
SERVICER_FUNCTIONS = [
    "cluster.serving.grpc_wire.add_GenerationServicer_to_server",
    "cluster.serving.grpc_wire.add_HealthServicer_to_server",
]


def engine_section(model_dir: pathlib.Path) -> dict[str, Any]:
    """Small on purpose: 4 running sequences and 3 waiting requests at most, so overload is easy
    to provoke; 256 blocks of 4 tokens."""
    return {
        "model": {"model": str(model_dir), "dtype": "float32", "max_model_len": MAX_MODEL_LEN},
        "parallel": {"backend": "local"},
        "cache": {"block_size": 4, "num_device_blocks": 256, "num_cpu_blocks": 16},
        "scheduler": {"max_num_seqs": 4, "max_num_batched_tokens": 64, "max_waiting_requests": 3},
    }


@dataclass(frozen=True)
class Served:
    http_base: str
    grpc_target: str

    def metrics(self) -> dict[str, float]:
        """The replica's Prometheus samples, keyed `name{label=value,...}` (labels sorted)."""
        text = httpx.get(f"{self.http_base}/metrics", timeout=10).text
        samples = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(
                    f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "replica"
                )
                samples[f"{sample.name}{{{labels}}}"] = sample.value
        return samples

    def wait_until_idle(self, timeout_s: float = 20.0) -> dict[str, float]:
        """Polls until no sequence runs or waits and no device block is referenced."""
        deadline = time.monotonic() + timeout_s
        while True:
            samples = self.metrics()
            busy = (
                samples["pagedserve_sequences{queue=running}"]
                + samples["pagedserve_sequences{queue=waiting}"]
                + samples["pagedserve_kv_cache_blocks{state=used,tier=device}"]
            )
            if busy == 0 or time.monotonic() > deadline:
                return samples
            time.sleep(0.05)


def quick_stop_options(**options: Any) -> dict[str, Any]:
    """Serve options for a test deployment: no CPUs reserved; a replica being stopped looks for
    ongoing requests every 0.2 s instead of Serve's 2 s, so deleting an idle test app takes no
    fixed wait (a busy one still drains as Serve drains it); and Serve health-checks each replica
    every second instead of every 10 s, so a replica a test kills is found dead (and replaced)
    within about a second rather than 5 s on average."""
    return {
        "ray_actor_options": {"num_cpus": 0},
        "graceful_shutdown_wait_loop_s": 0.2,
        "health_check_period_s": 1.0,
        **options,
    }


@pytest.fixture(scope="session")
def served(ray_cluster: None, tiny_model_dir: pathlib.Path) -> Iterator[Served]:
    from ray import serve

    from cluster.serving.serve_app import bind_app

    http_port, grpc_port = free_port(), free_port()
    try:
        serve.start(
            http_options={"host": "127.0.0.1", "port": http_port},
            grpc_options={"port": grpc_port, "grpc_servicer_functions": SERVICER_FUNCTIONS},
        )
        args = {
            "served_model_name": MODEL,
            "engine": engine_section(tiny_model_dir),
            "api_keys": API_KEYS,
            "shared_prefixes": [SHARED_SYSTEM_PROMPT],
        }
        app = bind_app(
            args,
            engine_options=quick_stop_options(max_ongoing_requests=64),
            ingress_options=quick_stop_options(),
        )
        serve.run(app, name="pagedserve", route_prefix="/")
        yield Served(f"http://127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}")
    finally:
        serve.shutdown()


@dataclass
class GreedyOracle:
    """Greedy decoding with HF transformers on the same weights, ignoring EOS."""

    model: transformers.PreTrainedModel
    tokenizer: transformers.PreTrainedTokenizerBase

    def prompt_ids(self, prompt: str | list[dict[str, str]]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt, add_special_tokens=True))
        text = self.tokenizer.apply_chat_template(
            prompt, tokenize=False, add_generation_prompt=True
        )
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    @torch.no_grad()
    def generate(self, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
        """The greedy tokens and each one's log-probability."""
        ids = list(prompt_ids)
        logprobs = []
        for _ in range(max_tokens):
            logits = self.model(torch.tensor([ids])).logits[0, -1].float()
            log_softmax = torch.log_softmax(logits, dim=-1)
            token = int(torch.argmax(logits))
            ids.append(token)
            logprobs.append(float(log_softmax[token]))
        return ids[len(prompt_ids) :], logprobs

    def text(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)


@pytest.fixture(scope="session")
def oracle(tiny_model_dir: pathlib.Path, tiny_hf: transformers.PreTrainedModel) -> GreedyOracle:
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    return GreedyOracle(tiny_hf, tokenizer)


@pytest.fixture(scope="session")
def serving_adapters(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: pathlib.Path
) -> dict[str, pathlib.Path]:
    """PEFT adapters of the tiny model (`tests/serving/lora_adapters.py`), built once."""
    from tests.serving.lora_adapters import build_serving_adapters

    return build_serving_adapters(tmp_path_factory.mktemp("serving_adapters"), tiny_model_dir)


@pytest.fixture(scope="session")
def _two_replica_app_deployed(
    served: Served, tiny_model_dir: pathlib.Path, serving_adapters: dict[str, pathlib.Path]
) -> Iterator[TwoReplicaApp]:
    from ray import serve

    args = two_replicas.app_args(
        MODEL, engine_section(tiny_model_dir), API_KEYS, serving_adapters["a"]
    )
    run_two_engine_app(two_replicas.APP, two_replicas.ROUTE, args)
    yield TwoReplicaApp(served.http_base + two_replicas.ROUTE, serving_adapters)
    serve.delete(two_replicas.APP)


@pytest.fixture
def two_replica_app(_two_replica_app_deployed: TwoReplicaApp) -> TwoReplicaApp:
    """The session's two-replica application (`tests/serving/two_replicas.py`), whole again:
    two engine replicas running and indexed by the KV directory."""
    two_replicas.wait_until_whole()
    return _two_replica_app_deployed


def run_two_engine_app(name: str, route_prefix: str, args: dict[str, Any]) -> Any:
    """Deploys the application (ingress + two engine replicas, no CPUs reserved, 16 ongoing
    requests per engine) on the session's Serve instance; returns the ingress's handle."""
    from ray import serve

    from cluster.serving.serve_app import bind_app

    app = bind_app(
        args,
        engine_options=quick_stop_options(num_replicas=2, max_ongoing_requests=16),
        ingress_options=quick_stop_options(),
    )
    return serve.run(app, name=name, route_prefix=route_prefix)
