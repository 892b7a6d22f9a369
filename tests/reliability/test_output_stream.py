"""Streams cost O(new tokens) per step and a slow reader holds one coalesced item: deltas carry
no copy of the prompt or of the output so far, the mailbox merges what the reader has not taken,
and the folded outputs stay exact (cumulative text and token ids). A stream interval (a server's
`stream_interval`) sends fewer, larger deltas without delaying the first token or the end."""

from __future__ import annotations

import asyncio
import pathlib
import pickle

import pytest

from cluster.engine.async_engine import AsyncEngine
from cluster.engine.output_stream import (
    BranchDelta,
    OutputAccumulator,
    OutputMailbox,
    RequestDelta,
    chunk_tokens,
)
from cluster.engine.sampling_params import SamplingParams
from tests.engine.streams import engine_outputs
from tests.engine.tiny_engine import tiny_config

LONG_PROMPT = list(range(100, 700))
PARAMS = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)


def delta(index: int, text: str, ids: list[int], finished: bool = False) -> RequestDelta:
    branch = BranchDelta(
        index=0, text=text, token_ids=ids, finish_reason="length" if finished else None
    )
    return RequestDelta(
        request_id="r",
        branches=[branch],
        finished=finished,
        num_cached_tokens=0,
        prompt_token_ids=[1, 2] if index == 0 else None,
    )


def test_the_mailbox_coalesces_what_the_reader_has_not_taken() -> None:
    async def scenario() -> None:
        mailbox = OutputMailbox()
        for i in range(1000):
            mailbox.put(delta(i, f"t{i} ", [i], finished=i == 999))
        assert mailbox.num_pending == 1000 and mailbox.merged == 999
        merged = await mailbox.get()
        assert mailbox.num_pending == 0
        assert merged.finished and merged.prompt_token_ids == [1, 2]
        assert merged.branches[0].token_ids == list(range(1000))
        assert merged.branches[0].text == "".join(f"t{i} " for i in range(1000))
        mailbox.fail(RuntimeError("gone"))
        try:
            await mailbox.get()
        except RuntimeError as error:
            assert str(error) == "gone"
        else:
            raise AssertionError("the error must end the stream")

    asyncio.run(scenario())


def test_the_accumulator_folds_deltas_into_exact_cumulative_outputs() -> None:
    accumulator = OutputAccumulator()
    first = accumulator.apply(delta(0, "a", [1]))
    assert first.prompt_token_ids == [1, 2] and first.outputs[0].token_ids == [1]
    second = accumulator.apply(delta(1, "bc", [2, 3], finished=True))
    assert second.outputs[0].text == "abc" and second.outputs[0].token_ids == [1, 2, 3]
    assert second.outputs[0].delta_text == "bc" and second.outputs[0].delta_token_ids == [2, 3]
    assert second.finished and second.usage.prompt_tokens == 2
    assert first.outputs[0].text == "a"  # text never changes after the fact


def test_a_slow_reader_gets_one_coalesced_output_and_exact_results(
    tiny_model_dir: pathlib.Path,
) -> None:
    async def scenario() -> None:
        engine = await AsyncEngine.create(tiny_config(tiny_model_dir))
        build = engine.request_builder.build
        # the reference: a reader that takes every output
        fast = [
            o
            async for o in engine_outputs(engine, build({"prompt_token_ids": LONG_PROMPT}, PARAMS))
        ]
        stream = engine_outputs(
            engine, build({"prompt_token_ids": LONG_PROMPT}, PARAMS, request_id="slow")
        )
        first = await anext(stream)
        mailbox = engine._streams["slow"]
        while engine.metrics().num_finished_requests < 2:  # the reader sleeps meanwhile
            await asyncio.sleep(0.01)
        assert mailbox.num_pending >= 2  # several steps' deltas wait as one item
        rest = [o async for o in stream]
        assert len(rest) == 1 and rest[0].finished
        final, reference = rest[0].outputs[0], fast[-1].outputs[0]
        assert final.token_ids == reference.token_ids and final.text == reference.text
        assert first.outputs[0].delta_token_ids + final.delta_token_ids == final.token_ids
        assert rest[0].prompt_token_ids == LONG_PROMPT and rest[0].usage.completion_tokens == 64
        await engine.shutdown()

    asyncio.run(scenario())


def test_deltas_do_not_grow_with_the_prompt_or_the_output(tiny_model_dir: pathlib.Path) -> None:
    """What a replica sends per step over a handle: pickled, every delta after the first is
    as small for a 600-token prompt 64 tokens in as for the first token of a short one."""

    async def scenario() -> None:
        engine = await AsyncEngine.create(tiny_config(tiny_model_dir))
        build = engine.request_builder.build
        sizes = []
        async for d in engine.generate(build({"prompt_token_ids": LONG_PROMPT}, PARAMS)):
            sizes.append(len(pickle.dumps(d)))
        assert len(sizes) == PARAMS.max_tokens
        assert sizes[0] > 4 * len(LONG_PROMPT) // 2  # the first carries the prompt once
        middle = sizes[1:-1]
        assert max(middle) < 600 and max(middle) - min(middle) < 64, sizes
        await engine.shutdown()

    asyncio.run(scenario())


def test_a_stream_interval_holds_deltas_back_but_never_the_first_token_or_the_end() -> None:
    async def scenario() -> None:
        mailbox = OutputMailbox()

        async def ready() -> RequestDelta | None:
            try:
                return await asyncio.wait_for(mailbox.get(3), timeout=0.05)
            except TimeoutError:
                return None

        assert await ready() is None  # nothing yet
        mailbox.put(delta(0, "a", [1]))
        first = await ready()
        assert first is not None and first.branches[0].token_ids == [1]  # at once
        mailbox.put(delta(1, "b", [2]))
        mailbox.put(delta(2, "c", [3]))
        assert await ready() is None  # 2 of 3 tokens: held back
        mailbox.put(delta(3, "d", [4]))
        full = await ready()
        assert full is not None and full.branches[0].token_ids == [2, 3, 4]
        assert full.branches[0].text == "bcd"
        mailbox.put(delta(4, "e", [5], finished=True))
        last = await ready()
        assert last is not None and last.finished and last.branches[0].token_ids == [5]
        mailbox.put(delta(5, "f", [6]))
        mailbox.fail(RuntimeError("gone"))
        held = await ready()  # what is pending goes out before the error
        assert held is not None and held.branches[0].token_ids == [6]
        try:
            await mailbox.get(3)
        except RuntimeError as error:
            assert str(error) == "gone"
        else:
            raise AssertionError("the error must end the stream")

    asyncio.run(scenario())


def test_a_reader_waiting_for_n_tokens_is_woken_once_they_are_there() -> None:
    """A stream interval must not cost the event loop one wake-up per step per request."""

    class CountingEvent(asyncio.Event):
        waits = 0

        async def wait(self) -> bool:
            CountingEvent.waits += 1
            return await super().wait()

    async def scenario() -> None:
        mailbox = OutputMailbox()
        mailbox._ready = CountingEvent()
        mailbox.put(delta(0, "a", [1]))
        assert (await mailbox.get(4)).branches[0].token_ids == [1]  # the first token: at once
        reader = asyncio.ensure_future(mailbox.get(4))
        for step in range(1, 5):
            await asyncio.sleep(0)
            mailbox.put(delta(step, "x", [step + 1]))
            await asyncio.sleep(0)
        chunk = await reader
        assert chunk.branches[0].token_ids == [2, 3, 4, 5]
        assert CountingEvent.waits == 1  # one wait, woken by the fourth token only

    asyncio.run(scenario())


def test_an_engine_stream_interval_sends_chunks_of_n_tokens_with_the_same_result(
    tiny_model_dir: pathlib.Path,
) -> None:
    async def scenario() -> None:
        engine = await AsyncEngine.create(tiny_config(tiny_model_dir))
        build = engine.request_builder.build
        prompt = {"prompt_token_ids": [5, 6]}
        every = [d async for d in engine.generate(build(prompt, PARAMS))]
        chunked = [d async for d in engine.generate(build(prompt, PARAMS, request_id="chunked"), 4)]
        tokens = [len(d.branches[0].token_ids) for d in chunked]
        assert tokens[0] == 1 and all(count >= 4 for count in tokens[1:-1]), tokens
        assert sum(tokens) == PARAMS.max_tokens and chunked[-1].finished
        assert len(chunked) <= 2 + (PARAMS.max_tokens - 1) // 4

        def ids(deltas: list[RequestDelta]) -> list[int]:
            return [t for d in deltas for t in d.branches[0].token_ids]

        def text(deltas: list[RequestDelta]) -> str:
            return "".join(d.branches[0].text for d in deltas)

        assert ids(chunked) == ids(every) and text(chunked) == text(every)
        with pytest.raises(ValueError, match="stream_interval"):
            await anext(engine.generate(build({"prompt_token_ids": [5]}, PARAMS), 0))
        await engine.shutdown()

    asyncio.run(scenario())


def test_chunk_tokens_grow_with_the_running_batch_past_the_stream_interval() -> None:
    assert [chunk_tokens(4, 2, running) for running in (0, 1, 8, 9, 16, 64)] == [4, 4, 4, 5, 8, 32]
    assert [chunk_tokens(1, 3, running) for running in (1, 3, 4, 7)] == [1, 1, 2, 3]
    assert chunk_tokens(4, None, 256) == 4  # unset: the interval alone
    with pytest.raises(ValueError, match="chunks_per_step"):
        chunk_tokens(1, 0, 8)
    with pytest.raises(ValueError, match="stream_interval"):
        chunk_tokens(0, 2, 8)


def test_an_engine_bounding_chunks_per_step_streams_a_full_batch_in_larger_chunks(
    tiny_model_dir: pathlib.Path,
) -> None:
    """Eight sequences running together with 2 chunks per step: every chunk between the first
    token and the last carries >= 4 tokens; a lone request still streams every token; the
    tokens and text are those of unpaced streams."""

    async def scenario() -> None:
        engine = await AsyncEngine.create(tiny_config(tiny_model_dir))
        build = engine.request_builder.build
        prompts = [{"prompt_token_ids": [5, 6 + i]} for i in range(8)]

        async def stream(prompt: dict, rid: str, chunks: int | None) -> list[RequestDelta]:
            request = build(prompt, PARAMS, request_id=rid)
            return [d async for d in engine.generate(request, 1, chunks)]

        paced = await asyncio.gather(*(stream(p, f"paced-{i}", 2) for i, p in enumerate(prompts)))
        unpaced = await asyncio.gather(
            *(stream(p, f"unpaced-{i}", None) for i, p in enumerate(prompts))
        )
        for chunked, every in zip(paced, unpaced, strict=True):
            tokens = [len(d.branches[0].token_ids) for d in chunked]
            assert tokens[0] == 1 and all(count >= 4 for count in tokens[1:-1]), tokens
            assert len(chunked) <= 2 + (PARAMS.max_tokens - 1) // 4
            assert [t for d in chunked for t in d.branches[0].token_ids] == [
                t for d in every for t in d.branches[0].token_ids
            ]
            assert "".join(d.branches[0].text for d in chunked) == "".join(
                d.branches[0].text for d in every
            )
        alone = await stream(prompts[0], "alone", 2)
        assert [len(d.branches[0].token_ids) for d in alone] == [1] * PARAMS.max_tokens
        with pytest.raises(ValueError, match="chunks_per_step"):
            await anext(engine.generate(build({"prompt_token_ids": [5]}, PARAMS), 1, 0))
        await engine.shutdown()

    asyncio.run(scenario())
