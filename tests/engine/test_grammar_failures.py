"""A grammar matcher that fails on one request fails that request alone: the other requests of
its batches finish with exactly the tokens they get when nothing fails (the oracle: the same
batch run without the fault), the failed one ends with an error naming the matcher's message,
and the engine goes on serving (the async engine's step loop stays alive)."""

from __future__ import annotations

import asyncio
import pathlib
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from cluster.engine.engine_core import EngineCore
from cluster.engine.errors import RequestFailed
from cluster.engine.grammar_guard import GuardedConstraint
from cluster.engine.outputs import RequestOutput
from cluster.engine.sampling_params import SamplingParams
from cluster.engine.structured_outputs import StructuredOutputsParams
from tests.engine.tiny_engine import tiny_config

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 99}},
    "required": ["ok", "n"],
}
JSON = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
FAULTY = "faulty"
SPECULATIVE = {
    "speculative_method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
}


class FailingMatcher:
    """A `TokenConstraint` that behaves as `real` until `operation` has been called `after`
    times, then raises what xgrammar raises on a state it cannot handle."""

    def __init__(self, real: Any, operation: str, after: int) -> None:
        self.real = real
        self.operation = operation
        self.calls_left = after

    def _maybe_fail(self, operation: str) -> None:
        if operation != self.operation:
            return
        if self.calls_left == 0:
            raise RuntimeError("injected matcher failure")
        self.calls_left -= 1

    @property
    def is_terminated(self) -> bool:
        return self.real.is_terminated

    def accept(self, token_id: int) -> bool:
        self._maybe_fail("accept")
        return self.real.accept(token_id)

    def sync(self, output_token_ids: Sequence[int]) -> None:
        self.real.sync(output_token_ids)

    def valid_drafts(self, drafts: Sequence[int]) -> int:
        self._maybe_fail("valid_drafts")
        return self.real.valid_drafts(drafts)

    def bitmasks(self, drafts: Sequence[int] = ()) -> torch.Tensor | None:
        self._maybe_fail("bitmasks")
        return self.real.bitmasks(drafts)


def _batch(core: EngineCore) -> list[Any]:
    """Constrained and free requests, greedy and seeded-sampled, on prompts whose n-grams
    repeat (so speculation drafts); the faulty one is constrained."""
    free = SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True)
    build = core.request_builder.build
    prompts = ['{"ok": true, "n": 1} {"ok": true, "n": 1} {"ok":', "1 2 3 1 2 3 1 2"]
    requests = [
        build(prompts[0], SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=JSON),
              request_id=FAULTY),
        build(prompts[0], SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=JSON),
              request_id="constrained-greedy"),
        build(prompts[1], SamplingParams(temperature=0.9, seed=5, max_tokens=24,
                                         structured_outputs=JSON), request_id="constrained-seeded"),
        build(prompts[1], free, request_id="free"),
    ]  # fmt: skip
    return requests


def _run(core: EngineCore, inject: tuple[str, int] | None) -> dict[str, RequestOutput]:
    for request in _batch(core):
        core.add_request(request)
    if inject is not None:
        guard = core.requests[FAULTY].branches[0].grammar
        assert isinstance(guard, GuardedConstraint)
        guard.inner = FailingMatcher(guard.inner, *inject)
    finals: dict[str, RequestOutput] = {}
    for _ in range(500):
        if not core.has_work():
            break
        for output in core.step():
            if output.finished or output.error is not None:
                finals[output.request_id] = output
    assert not core.has_unfinished()
    return finals


@pytest.mark.parametrize(
    ("operation", "after", "speculative"),
    [
        ("bitmasks", 2, False),  # while the step is planned
        ("accept", 3, False),  # while its output is applied
        ("valid_drafts", 0, True),  # while drafts are checked
        ("bitmasks", 1, True),  # the masks of a draft run
    ],
)
def test_a_failing_matcher_fails_only_its_request(
    tiny_model_dir: pathlib.Path, operation: str, after: int, speculative: bool
) -> None:
    sections: dict[str, Any] = {"speculative": SPECULATIVE} if speculative else {}
    core = EngineCore(tiny_config(tiny_model_dir, **sections))
    try:
        clean = _run(core, None)
        faulty = _run(core, (operation, after))
    finally:
        core.shutdown()
    assert clean[FAULTY].error is None
    failed = faulty.pop(FAULTY)
    assert failed.error is not None
    assert "grammar matcher failed" in failed.error
    assert "injected matcher failure" in failed.error
    assert len(faulty) == 3
    for request_id, output in faulty.items():
        assert output.error is None, request_id
        assert [c.token_ids for c in output.outputs] == [
            c.token_ids for c in clean[request_id].outputs
        ], request_id


def test_the_async_engine_keeps_serving_after_a_matcher_failure(
    tiny_model_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The failed request's stream raises RequestFailed (what every front end answers with its
    error body, SSE error event or gRPC status); the others' streams end normally, and a
    constrained request sent afterwards is served."""
    from cluster.engine.async_engine import AsyncEngine
    from tests.engine.streams import engine_outputs

    async def last(engine: AsyncEngine, request: Any) -> RequestOutput:
        final = None
        async for output in engine_outputs(engine, request):
            final = output
        assert final is not None
        return final

    async def scenario() -> None:
        engine = AsyncEngine(tiny_config(tiny_model_dir))
        add_request = engine.core.add_request

        def add_faulty(request: Any, constraint: Any = None) -> Any:
            added = add_request(request, constraint)
            if added.request_id == FAULTY:
                guard = added.branches[0].grammar
                guard.inner = FailingMatcher(guard.inner, "bitmasks", 2)
            return added

        monkeypatch.setattr(engine.core, "add_request", add_faulty)
        requests = _batch(engine.core)
        results = await asyncio.gather(*(last(engine, r) for r in requests), return_exceptions=True)
        failure = results[0]
        assert isinstance(failure, RequestFailed), failure
        assert "grammar matcher failed" in str(failure)
        assert all(isinstance(r, RequestOutput) and r.finished for r in results[1:]), results
        after = engine.core.request_builder.build(
            "Hi", SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=JSON)
        )
        assert (await last(engine, after)).finished
        await engine.shutdown()

    asyncio.run(scenario())
