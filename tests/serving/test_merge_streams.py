"""`merge_streams`, which fans in the engine streams of a batched completion: every item arrives
once, an error in one input ends the merge, and closing the merge closes every input (that is
what aborts the engine requests when a client goes away)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from typing import Any

import pytest

from cluster.serving.delta_streams import merge_streams


class Source:
    """An async generator standing in for an engine stream; records how it ended."""

    def __init__(
        self, items: list[Any], *, fail_after: int | None = None, endless: bool = False
    ) -> None:
        self.items, self.fail_after, self.endless = items, fail_after, endless
        self.closed = False

    async def stream(self) -> AsyncGenerator[Any]:
        try:
            for i, item in enumerate(self.items):
                if self.fail_after == i:
                    raise ValueError("engine refused")
                await asyncio.sleep(0)
                yield item
            while self.endless:
                await asyncio.sleep(0.001)
                yield "more"
        finally:
            self.closed = True


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_every_item_arrives_once_tagged_with_its_stream() -> None:
    sources = [Source(["a0", "a1", "a2"]), Source(["b0"]), Source([])]

    async def collect() -> list[tuple[int, Any]]:
        return [pair async for pair in merge_streams([s.stream() for s in sources])]

    merged = run(collect())
    assert sorted(merged) == [(0, "a0"), (0, "a1"), (0, "a2"), (1, "b0")]
    assert [item for index, item in merged if index == 0] == ["a0", "a1", "a2"]  # order kept
    assert all(s.closed for s in sources)


def test_an_error_in_one_input_ends_the_merge_and_closes_the_others() -> None:
    failing, endless = Source(["x", "y"], fail_after=1), Source(["z"], endless=True)

    async def drain() -> tuple[bool, bool]:
        with pytest.raises(ValueError, match="engine refused"):
            async for _ in merge_streams([failing.stream(), endless.stream()]):
                pass
        return failing.closed, endless.closed  # checked before asyncio.run cancels leftovers

    assert run(drain()) == (True, True)


def test_closing_the_merge_early_closes_every_input() -> None:
    sources = [Source(["a"], endless=True), Source(["b"], endless=True)]

    async def take_three() -> list[bool]:
        taken = 0
        async with contextlib.aclosing(merge_streams([s.stream() for s in sources])) as merged:
            async for _ in merged:
                taken += 1
                if taken == 3:
                    break
        return [s.closed for s in sources]  # checked before asyncio.run cancels leftovers

    assert run(take_three()) == [True, True]


@pytest.mark.parametrize("fail_after", [None, 1])
def test_a_single_stream_is_read_in_place_without_a_task(fail_after: int | None) -> None:
    source = Source(["a0", "a1", "a2"], fail_after=fail_after)
    seen_tasks: list[int] = []

    async def collect() -> list[tuple[int, Any]]:
        pairs = []
        async for pair in merge_streams([source.stream()]):
            seen_tasks.append(len(asyncio.all_tasks()))
            pairs.append(pair)
        return pairs

    if fail_after is None:
        assert run(collect()) == [(0, "a0"), (0, "a1"), (0, "a2")]
    else:
        with pytest.raises(ValueError, match="engine refused"):
            run(collect())
    assert seen_tasks and set(seen_tasks) == {1}  # only the test's own task ever ran
    assert source.closed
