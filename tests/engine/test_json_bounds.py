"""What keeps a constrained answer able to end: the bounds put on what a schema leaves open
(every output they allow is valid under the user's schema, `jsonschema`; what the user bounded
stays as given), and the guard against a token cycle repeating without end (checked on token
bitmasks against a plain reading of the bits)."""

from __future__ import annotations

import copy

import jsonschema
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.engine.cycle_guard import CYCLE_TOKENS, cut_cycles, cycle_continuation
from cluster.engine.json_bounds import MAX_INTEGER_DIGITS, MAX_OPEN_STRING, bounded_schema

CITY = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "code": {"type": "string", "maxLength": 3},
        "zip": {"type": "string", "pattern": "^[0-9]+$"},
        "population": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"type": ["string", "null"]}},
        "area": {"anyOf": [{"type": "integer"}, {"$ref": "#/$defs/label"}]},
    },
    "$defs": {"label": {"type": "string"}},
}


def test_open_lengths_are_bounded_and_given_ones_kept() -> None:
    original = copy.deepcopy(CITY)
    bounded = bounded_schema(CITY)
    assert original == CITY  # a copy: the user's schema is untouched
    props = bounded["properties"]
    assert props["name"]["maxLength"] == MAX_OPEN_STRING
    assert props["code"] == {"type": "string", "maxLength": 3}
    assert props["zip"] == CITY["properties"]["zip"]
    assert props["population"] == {
        "type": "integer",
        "minimum": 0,
        "maximum": 10**MAX_INTEGER_DIGITS - 1,
    }
    assert props["tags"]["items"]["maxLength"] == MAX_OPEN_STRING
    assert props["area"]["anyOf"][0]["minimum"] == -(10**MAX_INTEGER_DIGITS - 1)
    assert bounded["$defs"]["label"]["maxLength"] == MAX_OPEN_STRING


@settings(max_examples=80, deadline=None)
@given(
    name=st.text(max_size=300),
    population=st.integers(0, 10**20),
    tags=st.lists(st.none() | st.text(max_size=300), max_size=3),
)
def test_what_the_bounds_allow_the_schema_allows(
    name: str, population: int, tags: list[str | None]
) -> None:
    answer = {"name": name, "population": population, "tags": tags}
    bounded = bounded_schema(CITY)
    if jsonschema.Draft202012Validator(bounded).is_valid(answer):
        jsonschema.validate(answer, CITY)
    else:
        assert (
            len(name) > MAX_OPEN_STRING
            or population >= 10**MAX_INTEGER_DIGITS
            or any(tag is not None and len(tag) > MAX_OPEN_STRING for tag in tags)
        )


@pytest.mark.parametrize(
    ("history", "expected"),
    [
        ([7] * CYCLE_TOKENS, 7),
        ([7] * (CYCLE_TOKENS - 1), None),
        ([1, 2] * (CYCLE_TOKENS // 2), 1),
        ([5, 1, 2, 3] * (CYCLE_TOKENS // 4), 5),
        ([9, 1, 2, 3, 4, 5] * CYCLE_TOKENS, None),  # longer than a short cycle
        ([*range(CYCLE_TOKENS)], None),
    ],
)
def test_a_short_cycle_filling_the_end_is_found(history: list[int], expected: int | None) -> None:
    assert cycle_continuation(history) == expected


def _allowed(row: torch.Tensor, vocab: int) -> set[int]:
    words = [int(w) & 0xFFFFFFFF for w in row]
    return {t for t in range(vocab) if words[t // 32] >> (t % 32) & 1}


def test_the_cycle_token_is_masked_unless_it_is_the_only_one() -> None:
    vocab = 96
    masks = torch.full((2, 3), -1, dtype=torch.int32)
    cut_cycles(masks, [63] * CYCLE_TOKENS, drafts=[5])
    assert _allowed(masks[0], vocab) == set(range(vocab)) - {63}  # bit 31 of a word
    assert _allowed(masks[1], vocab) == set(range(vocab))  # after the draft: no cycle
    only = torch.zeros((1, 3), dtype=torch.int32)
    only[0, 1] = 1 << 8  # token 40 alone
    cut_cycles(only, [40] * CYCLE_TOKENS, drafts=[])
    assert _allowed(only[0], vocab) == {40}
