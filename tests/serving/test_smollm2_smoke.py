"""One smoke test with the real default model: the application exactly as
`cluster/serving/serve_config.yaml` ships it (SmolLM2-135M-Instruct), deployed next to the tiny one,
answers a factual question."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import yaml

from tests.serving.conftest import Served, quick_stop_options

CONFIG = Path(__file__).resolve().parents[2] / "cluster" / "serving" / "serve_config.yaml"
ROUTE = "/smollm2"


@pytest.fixture(scope="module")
def smollm2(served: Served) -> Iterator[tuple[openai.OpenAI, str]]:
    from ray import serve

    from cluster.serving.serve_app import bind_app, build_app

    (app,) = yaml.safe_load(CONFIG.read_text())["applications"]
    build_app(app["args"])  # validates the shipped args, engine section included
    options = quick_stop_options()
    graph = bind_app(app["args"], engine_options=options, ingress_options=options)
    serve.run(graph, name="smollm2", route_prefix=ROUTE)
    try:
        client = openai.OpenAI(base_url=f"{served.http_base}{ROUTE}/v1", api_key="-", max_retries=0)
        yield client, app["args"]["served_model_name"]
    finally:
        serve.delete("smollm2")


def test_smollm2_knows_the_capital_of_france(smollm2: tuple[openai.OpenAI, str]) -> None:
    client, model = smollm2
    response = client.chat.completions.create(
        model=model,
        # Not the bare question: its first token is a near-tie (0.08 logits in float32).
        messages=[
            {"role": "user", "content": "What is the capital of France? Answer in one sentence."}
        ],
        max_tokens=24,
        temperature=0,
    )
    (choice,) = response.choices
    assert "Paris" in (choice.message.content or "")
    assert choice.finish_reason == "stop"  # the model ended its answer itself (EOS)
