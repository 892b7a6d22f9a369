"""The engine's view of the tokenizer: prompt encoding, chat rendering and identity digests.

The digests feed the block manager's `CacheIdentity`: two tokenizers that could map the same text
to different ids, or two chat templates that render the same messages differently, never share
cached blocks.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from transformers import PreTrainedTokenizerBase
from transformers.tokenization_utils_tokenizers import TokenizersBackend

from cluster.engine.detokenizer import TokenDecoder
from cluster.engine.errors import RequestRejected

NO_TEMPLATE = "none"

ChatMessages = Sequence[Mapping[str, Any]]

RENDER_OWN = frozenset(
    {"conversation", "messages", "tools", "chat_template", "tokenize", "add_generation_prompt"}
    | {"return_dict", "continue_final_message", "documents", "tokenizer_kwargs"}
)
"""Template variables and `apply_chat_template` arguments the renderer sets itself: a request's
`chat_template_kwargs` cannot replace them (the edge refuses them, naming the key)."""


@dataclass(frozen=True)
class RenderedPrompt:
    """A prompt ready for the scheduler: its ids, the text if any, and the template digest."""

    token_ids: list[int]
    text: str | None
    chat_template_digest: str = NO_TEMPLATE


def tokenizer_digest(tokenizer: PreTrainedTokenizerBase) -> str:
    """sha256 of everything that decides text -> ids: vocabulary, merges, normalization,
    pre-tokenization, added and special tokens (the fast tokenizer's canonical JSON)."""
    hasher = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        hasher.update(backend.to_str().encode())
    else:
        vocab = sorted(tokenizer.get_vocab().items())
        hasher.update(json.dumps(vocab).encode())
    special = {str(k): str(v) for k, v in tokenizer.special_tokens_map.items()}
    hasher.update(json.dumps(special, sort_keys=True).encode())
    return hasher.hexdigest()


def exact_backend_decode(tokenizer: PreTrainedTokenizerBase) -> Any | None:
    """The Rust tokenizer's `decode` when `tokenizer.decode` is exactly it (a fast tokenizer
    whose class keeps the base `_decode` and that cleans up no spaces afterwards), else None.
    It skips transformers' per-call argument conversion, most of a short decode's cost."""
    if not isinstance(tokenizer, TokenizersBackend):
        return None
    if type(tokenizer)._decode is not TokenizersBackend._decode:
        return None
    if type(tokenizer).decode is not PreTrainedTokenizerBase.decode:
        return None
    if tokenizer.clean_up_tokenization_spaces:
        return None
    return tokenizer.backend_tokenizer.decode


def template_digest(template: str) -> str:
    return hashlib.sha256(template.encode()).hexdigest()


class PromptRenderer:
    """Encodes text, renders chat messages and checks token ids, for one tokenizer."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.digest = tokenizer_digest(tokenizer)
        self._backend_decode = exact_backend_decode(tokenizer)
        self._token_decoders: dict[bool, TokenDecoder] = {}

    def render(
        self,
        prompt: str | ChatMessages | Mapping[str, Any],
        *,
        chat_template: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> RenderedPrompt:
        """Text, chat messages (a list of {"role", "content"}), {"prompt_token_ids": [...]} or
        {"prompt": text} (vLLM's `TokensPrompt` and `TextPrompt`); `tools` (OpenAI's tool
        definitions) and `chat_template_kwargs` (extra template variables, vLLM's, e.g.
        `enable_thinking`) are passed to the chat template."""
        if isinstance(prompt, Mapping) and set(prompt) == {"prompt"}:
            prompt = prompt["prompt"]
            if not isinstance(prompt, str):
                raise RequestRejected(f"'prompt' must be a string, got {type(prompt).__name__}")
        if isinstance(prompt, str):
            return RenderedPrompt(token_ids=self.encode(prompt), text=prompt)
        if isinstance(prompt, Mapping):
            return self._from_token_ids(prompt)
        if isinstance(prompt, Sequence):
            return self.render_chat(
                prompt,
                chat_template=chat_template,
                tools=tools,
                chat_template_kwargs=chat_template_kwargs,
            )
        raise RequestRejected(
            "prompt must be a string, a list of chat messages or {'prompt_token_ids': [...]}, "
            f"got {type(prompt).__name__}"
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A text prompt's ids (with the tokenizer's special tokens, as a prompt gets them);
        RequestRejected when there are none."""
        ids = list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        if not ids:
            raise RequestRejected("the prompt is empty after tokenization")
        return ids

    def bad_words_token_ids(self, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
        """`SamplingParams.bad_words` as token sequences: each word's tokens as it starts a text
        (leading spaces stripped), and also as it follows a space when that spelling is other
        tokens, so the word is banned at the start and within the text. (vLLM adds the spaced
        spelling only when it has as many tokens as the bare one, which leaves " dinner", one
        token, allowed when "dinner" is two.) Raises RequestRejected for a word with no
        tokens."""
        sequences: list[tuple[int, ...]] = []
        for word in words:
            bare = tuple(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
            if not bare:
                raise RequestRejected(f"bad word {word!r} has no tokens")
            sequences.append(bare)
            spaced = tuple(self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            if spaced and spaced != bare:
                sequences.append(spaced)
        return tuple(sequences)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """`tokenizer.decode`, straight from the Rust tokenizer when that is the same text
        (the incremental detokenizer calls this twice per generated token)."""
        if self._backend_decode is not None:
            return self._backend_decode(token_ids, skip_special_tokens)  # by position: cheaper
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_decoder(self, skip_special_tokens: bool) -> TokenDecoder:
        """The `TokenDecoder` every detokenizer of this renderer shares for the flag: `decode`
        bound, the Rust tokenizer's own when `decode` calls it as it is, called with its
        arguments by position (a keyword costs the Rust binding more than the decode)."""
        decoder = self._token_decoders.get(skip_special_tokens)
        if decoder is None:
            decoder = TokenDecoder(self._bound_decode(skip_special_tokens))
            self._token_decoders[skip_special_tokens] = decoder
        return decoder

    def _bound_decode(self, skip_special_tokens: bool) -> Callable[[list[int]], str]:
        backend = self._backend_decode
        if backend is None:
            return partial(self.decode, skip_special_tokens=skip_special_tokens)
        if skip_special_tokens:  # the Rust tokenizer's default
            return backend  # type: ignore[no-any-return]

        def decode_keeping_special(token_ids: list[int]) -> str:
            return backend(token_ids, False)  # type: ignore[no-any-return]

        return decode_keeping_special

    def render_chat(
        self,
        messages: ChatMessages,
        *,
        chat_template: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        add_special_tokens: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> RenderedPrompt:
        """Renders with `chat_template` or the model's own; the digest is of the one used.
        A prompt for generation ends with the assistant's header (`add_generation_prompt`) and
        gets no special tokens beyond what the template writes (`add_special_tokens`); the
        other values are for `/tokenize`, which may ask for them. `chat_template_kwargs` become
        template variables (never the ones set here: the messages, tools, template and
        generation prompt)."""
        template = chat_template or self.tokenizer.chat_template
        if not template:
            raise RequestRejected("this model has no chat template; send a text prompt instead")
        for message in messages:
            if not isinstance(message, Mapping) or "role" not in message:
                raise RequestRejected(f"each chat message needs a 'role', got {message!r}")
        text = self.tokenizer.apply_chat_template(
            [dict(m) for m in messages],
            chat_template=template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            tools=[dict(t) for t in tools] if tools else None,
            **{k: v for k, v in (chat_template_kwargs or {}).items() if k not in RENDER_OWN},
        )
        # the template writes the special tokens itself (e.g. BOS): a generation prompt adds none
        ids = list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        if not ids:
            raise RequestRejected("the chat prompt is empty after rendering")
        return RenderedPrompt(
            token_ids=ids, text=text, chat_template_digest=template_digest(template)
        )

    def _from_token_ids(self, prompt: Mapping[str, Any]) -> RenderedPrompt:
        if set(prompt) != {"prompt_token_ids"}:
            raise RequestRejected(
                "a dict prompt must be exactly {'prompt_token_ids': [...]} or {'prompt': text}, "
                f"got keys {sorted(prompt)}"
            )
        ids = prompt["prompt_token_ids"]
        if not isinstance(ids, Sequence) or not ids:
            raise RequestRejected("prompt_token_ids must be a non-empty list of ints")
        for token in ids:
            if not isinstance(token, int) or not 0 <= token < self.vocab_size:
                raise RequestRejected(
                    f"prompt_token_ids holds {token!r}, not a token id in [0, {self.vocab_size})"
                )
        return RenderedPrompt(token_ids=list(ids), text=None)
