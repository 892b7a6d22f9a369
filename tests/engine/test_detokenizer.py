"""Incremental detokenization and stop strings against the oracle: one full decode of all tokens."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.engine.detokenizer import IncrementalDetokenizer, TextTracker, TokenDecoder
from cluster.engine.tokenization import PromptRenderer, exact_backend_decode

TEXTS = [
    "Hello 世界 🙂 world, naïve café — ok",
    "emoji run: 👩‍💻🚀🎉 and math ∑∫√ and Ελληνικά",
    "plain ascii text with   spaces\nand newlines\n\n",
]


def stream(tokenizer: Any, token_ids: list[int], stop: list[str], include: bool) -> tuple[str, Any]:
    """Feeds tokens one by one, like the engine; returns the concatenated deltas and the match."""
    tracker = TextTracker(
        IncrementalDetokenizer(TokenDecoder.over(tokenizer, True), [1]),
        stop,
        include_stop_str_in_output=include,
    )
    deltas = []
    match = None
    for token in token_ids:
        match = tracker.add_tokens([token])
        delta = tracker.take_delta(finished=match is not None)
        assert "\ufffd" not in delta
        deltas.append(delta)
        if match is not None:
            break
    if match is None:
        match = tracker.finish()
        deltas.append(tracker.take_delta(finished=True))
    assert "".join(deltas) == tracker.text
    return "".join(deltas), match


def test_streamed_text_equals_full_decode(smollm2_tokenizer: Any) -> None:
    for text in TEXTS:
        ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
        assert any("\ufffd" in smollm2_tokenizer.decode([i]) for i in ids) or text.isascii()
        streamed, match = stream(smollm2_tokenizer, ids, [], include=False)
        assert match is None
        assert streamed == smollm2_tokenizer.decode(ids)


def test_stop_string_split_across_tokens(smollm2_tokenizer: Any) -> None:
    text = "The answer is forty-two. END OF ANSWER and then more text"
    ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
    pieces = [smollm2_tokenizer.decode([i]) for i in ids]
    stop = "two. EN"
    assert not any(stop in piece for piece in pieces), "the stop string must span tokens"
    streamed, match = stream(smollm2_tokenizer, ids, [stop], include=False)
    assert match is not None and match.stop == stop
    assert streamed == "The answer is forty-"
    streamed, _ = stream(smollm2_tokenizer, ids, [stop], include=True)
    assert streamed == "The answer is forty-two. EN"


def test_stop_string_inside_a_multibyte_character_run(smollm2_tokenizer: Any) -> None:
    text = "abc 世界 def"
    ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
    streamed, match = stream(smollm2_tokenizer, ids, ["界 d"], include=False)
    assert match is not None and streamed == "abc 世"


def test_held_back_prefix_is_released_when_it_does_not_complete(smollm2_tokenizer: Any) -> None:
    ids = smollm2_tokenizer.encode("one STOP? no: STOPPED", add_special_tokens=False)
    streamed, match = stream(smollm2_tokenizer, ids, ["STOPX"], include=False)
    assert match is None and streamed == "one STOP? no: STOPPED"


ALPHABET = st.sampled_from(list("ab c.世界🙂é\n-"))


@settings(max_examples=60, deadline=None)
@given(
    text=st.lists(ALPHABET, min_size=1, max_size=30).map("".join),
    stop_start=st.integers(0, 29),
    stop_len=st.integers(1, 4),
    include=st.booleans(),
)
def test_property_stream_equals_decode_cut_at_first_stop(
    smollm2_tokenizer: Any, text: str, stop_start: int, stop_len: int, include: bool
) -> None:
    ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
    full = smollm2_tokenizer.decode(ids)
    start = min(stop_start, len(full) - 1)
    stop = full[start : start + stop_len]
    streamed, match = stream(smollm2_tokenizer, ids, [stop], include=include)
    first = full.find(stop)
    assert match is not None
    assert streamed == full[: first + (len(stop) if include else 0)]


@pytest.fixture(scope="module")
def smollm2_renderer(smollm2_tokenizer: Any) -> PromptRenderer:
    """One renderer for every example (building one takes tens of milliseconds)."""
    return PromptRenderer(smollm2_tokenizer, vocab_size=49152)


@settings(deadline=None)
@given(
    ids=st.lists(st.integers(min_value=0, max_value=49151), max_size=12),
    skip=st.booleans(),
)
def test_renderer_decode_is_the_tokenizers_decode(
    smollm2_tokenizer: Any, smollm2_renderer: PromptRenderer, ids: list[int], skip: bool
) -> None:
    """The renderer's fast decode gives `tokenizer.decode`'s text for any ids, special tokens
    (0-16 in SmolLM2's vocabulary) and bytes of split characters included."""
    assert smollm2_renderer.decode(ids, skip_special_tokens=skip) == smollm2_tokenizer.decode(
        ids, skip_special_tokens=skip
    )


def test_renderer_keeps_transformers_decode_when_it_cleans_up_spaces(
    smollm2_tokenizer: Any,
) -> None:
    """A tokenizer that post-processes decoded text is never bypassed."""
    cleaning = copy.deepcopy(smollm2_tokenizer)
    cleaning.clean_up_tokenization_spaces = True
    assert exact_backend_decode(cleaning) is None
    assert exact_backend_decode(smollm2_tokenizer) is not None
    renderer = PromptRenderer(cleaning, vocab_size=49152)
    ids = cleaning.encode("Hello , world . It 's here", add_special_tokens=False)
    assert renderer.decode(ids) == cleaning.decode(ids, skip_special_tokens=True)
