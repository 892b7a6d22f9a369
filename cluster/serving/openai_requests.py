"""The OpenAI-compatible request models: completions and chat completions, as validated
at the edge, and their engine sampling fields.

A request body is parsed and validated into a request model (`parse_request`) and turned into
the engine's sampling fields (`sampling_kwargs`).

Invariants:
- Bad input never becomes a 500: a wrong type, an out-of-range value or an unsupported feature
  raises `OpenAIError` with status 400, naming the offending parameter.
- Types are strict (`"5"` is not an integer, `1` is not a boolean), as in OpenAI's API; unknown
  fields are ignored so newer clients keep working.
- `sampling_kwargs` returns exactly the keyword arguments of the engine's `SamplingParams`;
  a sampling field the request leaves unset (absent or null) takes the model's generation
  default (`GenerationDefaults`), an explicit value always wins.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal, TypedDict, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PrivateAttr

from cluster.engine.generation_defaults import GenerationDefaults
from cluster.engine.structured_outputs import StructuredOutputsParams
from cluster.engine.tokenization import RENDER_OWN
from cluster.serving.openai_protocol import invalid_request, parse_object
from cluster.serving.structured_fields import (
    FieldError,
    ResponseFormat,
    StructuredOutputsField,
    structured_outputs_of,
)
from cluster.serving.tool_calls import (
    NamedToolChoice,
    ToolCallIn,
    ToolDef,
    ToolPlan,
    ToolSettings,
    plan_tools,
    template_messages,
)

MAX_STOP_SEQUENCES = 16
MAX_N = 128
MAX_LOGPROBS = 20
MAX_STOP_CHARS = 1024
"""Longest stop string: stop strings are matched against the text after every step."""
MAX_LOGIT_BIAS = 100.0
"""OpenAI's bound on a `logit_bias` value (either sign)."""
_TOKEN_ID_KEY = re.compile(r"[0-9]{1,10}")
"""A `logit_bias` key, a token id as OpenAI's API writes it: decimal digits (at most 10, so
`int` stays cheap; the value must also be below 2**32)."""


def _token_biases(biases: dict[str, float]) -> dict[str, float]:
    """`logit_bias` checked: keys are token ids in decimal, values finite and within
    [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS]. Ids beyond the model's vocabulary are the engine's to
    refuse (it knows the vocabulary)."""
    for key, bias in biases.items():
        if not (_TOKEN_ID_KEY.fullmatch(key) and int(key) < 2**32):
            raise ValueError(f"keys must be token ids (integers in [0, 2**32)), got {key!r}")
        if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:  # False for NaN too
            raise ValueError(f"the bias of token {key} must be in [-100, 100], got {bias!r}")
    return biases


def _non_blank(word: str) -> str:
    """A bad word: text with something besides whitespace."""
    if not word.strip():
        raise ValueError(f"a bad word must not be blank, got {word!r}")
    return word


PRIORITY_MIN, PRIORITY_MAX = -(2**31), 2**31 - 1
"""A request's `priority` is a 32-bit integer on every front end (gRPC's `int32`)."""

Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]
"""`presence_penalty` / `frequency_penalty`: OpenAI's range."""


class _Edge(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Edge):
    include_usage: bool = False


class _SamplingRequest(_Edge):
    """Fields shared by completions and chat completions; `top_k`, `ignore_eos`,
    `stop_token_ids`, `include_stop_str_in_output`, `repetition_penalty`, `min_p`,
    `min_tokens`, `allowed_token_ids`, `bad_words`, `truncate_prompt_tokens`,
    `prompt_logprobs` and `priority` are vLLM's extensions beyond OpenAI's API. Float fields
    take JSON integers too (`"temperature": 1`), as OpenAI's API does; `logit_bias` maps
    token ids written as strings (`{"50256": -100}`) to biases. `min_tokens` never exceeds the
    request's token limit (its own checked by `check_supported`, a default one, which depends
    on the route and the model, by `sampling_kwargs`)."""

    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: (
        Annotated[str, Field(max_length=MAX_STOP_CHARS)]
        | Annotated[
            list[Annotated[str, Field(max_length=MAX_STOP_CHARS)]],
            Field(max_length=MAX_STOP_SEQUENCES),
        ]
        | None
    ) = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    user: str | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] | None = None
    logit_bias: Annotated[dict[str, float], AfterValidator(_token_biases)] | None = None
    allowed_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)] | None = (
        None
    )
    bad_words: list[Annotated[str, AfterValidator(_non_blank)]] | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    priority: Annotated[int, Field(ge=PRIORITY_MIN, le=PRIORITY_MAX)] = 0
    """vLLM's extension: the request's scheduling priority (lower runs first); non-zero only on
    a server started with `--scheduling-policy priority` (else a 400 from the engine)."""
    _constraint: tuple[StructuredOutputsParams | None] | None = PrivateAttr(default=None)

    def _check_supported(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise invalid_request(
                "stream_options is only allowed when stream is true", "stream_options"
            )
        self._check_min_tokens(self._requested_max_tokens())
        if self.prompt_logprobs is not None and self.stream:
            raise invalid_request(
                "prompt_logprobs is not supported with stream by this server", "prompt_logprobs"
            )
        if self.truncate_prompt_tokens == 0:
            raise invalid_request(
                "truncate_prompt_tokens (0) must be -1 or at least 1", "truncate_prompt_tokens"
            )
        if isinstance(self.stop, list) and any(s == "" for s in self.stop):
            raise invalid_request("stop sequences must not be empty", "stop")
        self.constraint()

    API_MAX_TOKENS: ClassVar[int | None] = None
    """The token limit of a request that gives none, unless the model's generation config
    gives one (None: until the context is full)."""

    def _requested_max_tokens(self) -> int | None:
        """The request's own token limit (None: it gives none)."""
        return self.max_tokens

    def _check_min_tokens(self, limit: int | None) -> None:
        """A 400 naming `min_tokens` when it exceeds the token `limit` (None: no limit)."""
        if self.min_tokens is not None and limit is not None and self.min_tokens > limit:
            raise invalid_request(
                f"min_tokens ({self.min_tokens}) must not exceed the request's max_tokens "
                f"({limit})",
                "min_tokens",
            )

    def constraint(self) -> StructuredOutputsParams | None:
        """`response_format` / `structured_outputs` as the engine's constraint (a 400 naming
        the field when it cannot compile; see `structured_fields`). Checked once: later calls
        (on the event loop) reuse the result of `check_supported` (off it)."""
        if self._constraint is None:
            try:
                params = structured_outputs_of(self.response_format, self.structured_outputs)
            except FieldError as error:
                raise invalid_request(error.message, error.param) from None
            self._constraint = (params,)
        return self._constraint[0]

    @property
    def include_usage(self) -> bool:
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    def _stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class SamplingKwargs(TypedDict):
    """Keyword arguments of the engine's `SamplingParams`, as the edge derives them."""

    n: int
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: list[str]
    stop_token_ids: list[int]
    logprobs: int | None
    ignore_eos: bool
    include_stop_str_in_output: bool
    structured_outputs: StructuredOutputsParams | None
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_p: float
    min_tokens: int
    logit_bias: dict[int, float] | None
    allowed_token_ids: list[int] | None
    bad_words: list[str] | None
    truncate_prompt_tokens: int | None
    prompt_logprobs: int | None


def _sampling_kwargs(
    request: _SamplingRequest, logprobs: int | None, defaults: GenerationDefaults
) -> SamplingKwargs:
    """The engine's fields; an unset (or null) field takes the model's generation default
    (`defaults`), else the engine's own; an empty `logit_bias` is None."""
    max_tokens = defaults.max_tokens_or(request._requested_max_tokens(), request.API_MAX_TOKENS)
    request._check_min_tokens(max_tokens)
    sampling = defaults.fill(
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=None if request.top_k is None else max(request.top_k, 0),  # -1: disabled, as 0
        min_p=request.min_p,
        repetition_penalty=request.repetition_penalty,
    )
    return SamplingKwargs(
        n=request.n,
        max_tokens=max_tokens,
        temperature=sampling["temperature"],
        top_p=sampling["top_p"],
        top_k=sampling["top_k"],
        seed=request.seed,
        stop=request._stop_list(),
        stop_token_ids=list(request.stop_token_ids or []),
        logprobs=logprobs,
        ignore_eos=request.ignore_eos,
        include_stop_str_in_output=request.include_stop_str_in_output,
        structured_outputs=request.constraint(),
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
        repetition_penalty=sampling["repetition_penalty"],
        min_p=sampling["min_p"],
        min_tokens=request.min_tokens or 0,
        logit_bias=(
            {int(k): v for k, v in request.logit_bias.items()} if request.logit_bias else None
        ),
        allowed_token_ids=request.allowed_token_ids,
        bad_words=request.bad_words or None,
        truncate_prompt_tokens=request.truncate_prompt_tokens,
        prompt_logprobs=request.prompt_logprobs,
    )


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
Prompt = str | TokenIds
"""One prompt: text, or token ids that skip the tokenizer."""


class CompletionRequest(_SamplingRequest):
    """`POST /v1/completions`. A list of prompts is a batch: choice `i * n + j` is the `j`-th
    completion of prompt `i`."""

    prompt: (
        str
        | Annotated[list[str], Field(min_length=1)]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1)]
    )
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check_supported(self) -> None:
        """Raise a 400 for a valid request this server cannot honour."""
        self._check_supported()
        if self.echo and self.stream:
            raise invalid_request("echo is not supported with stream by this server", "echo")
        if self.suffix:
            raise invalid_request("suffix is not supported by this server", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise invalid_request("best_of other than n is not supported", "best_of")

    def prompts(self) -> list[Prompt]:
        if isinstance(self.prompt, str):
            return [self.prompt]
        if all(isinstance(p, int) for p in self.prompt):
            return [list(self.prompt)]  # type: ignore[arg-type]
        return list(self.prompt)  # type: ignore[arg-type]

    API_MAX_TOKENS: ClassVar[int | None] = 16
    """OpenAI's completions default."""

    def sampling_kwargs(self, defaults: GenerationDefaults) -> SamplingKwargs:
        """`echo` with `logprobs` asks the engine for the prompt's logprobs too (the choice's
        logprobs then start with the prompt's tokens, the first without any); unset fields
        take `defaults`."""
        kwargs = _sampling_kwargs(self, self.logprobs, defaults)
        if self.echo and self.logprobs is not None:
            kwargs["prompt_logprobs"] = max(self.logprobs, self.prompt_logprobs or 0)
        return kwargs


class ContentPart(_Edge):
    """A part of a message's content; only `{"type": "text", "text": ...}` is supported (checked
    in `ChatCompletionRequest.check_supported` so the error names the part's type)."""

    type: str
    text: str | None = None


class ChatMessage(_Edge):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text or "" for part in self.content)


class ChatCompletionRequest(_SamplingRequest):
    """`POST /v1/chat/completions`. Text content only."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    """vLLM's: extra variables for the chat template (e.g. `{"enable_thinking": false}` for
    Qwen3); none may be one the renderer sets itself (`tokenization.RENDER_OWN`)."""

    def check_supported(self) -> None:
        """Raise a 400 for a valid request this server cannot honour."""
        self._check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid_request("top_logprobs requires logprobs to be true", "top_logprobs")
        for key in self.chat_template_kwargs or {}:
            if key in RENDER_OWN:
                raise invalid_request(
                    f"chat_template_kwargs cannot set {key!r}: the server sets it",
                    f"chat_template_kwargs.{key}",
                )
        for i, message in enumerate(self.messages):
            for j, part in enumerate(message.content if isinstance(message.content, list) else []):
                if part.type != "text" or part.text is None:
                    raise invalid_request(
                        f"content parts of type {part.type!r} are not supported, only 'text' "
                        "parts with a 'text' field",
                        f"messages[{i}].content[{j}]",
                    )

    def chat_messages(self) -> list[dict[str, Any]]:
        """Messages as the chat template takes them (see `tool_calls.template_messages`)."""
        return template_messages(self.messages)

    def tool_plan(self, settings: ToolSettings) -> ToolPlan | None:
        """What the request's tools ask for (a 400 naming the field when they cannot be
        honoured; see `tool_calls.plan_tools`)."""
        try:
            plan = plan_tools(self.tools, self.tool_choice, self.parallel_tool_calls, settings)
        except FieldError as error:
            raise invalid_request(error.message, error.param) from None
        if plan is not None and plan.constrained and self.constraint() is not None:
            raise invalid_request(
                f"tool_choice {plan.mode!r} cannot be combined with response_format or "
                "structured_outputs",
                "tool_choice",
            )
        return plan

    def _requested_max_tokens(self) -> int | None:
        """`max_completion_tokens` wins over the deprecated `max_tokens`; neither means the
        model's default or "until the context is full" (`max_tokens=None`)."""
        return self.max_completion_tokens or self.max_tokens

    def sampling_kwargs(self, defaults: GenerationDefaults) -> SamplingKwargs:
        """The engine's fields; unset ones take `defaults`."""
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return _sampling_kwargs(self, logprobs, defaults)


RequestT = TypeVar("RequestT", CompletionRequest, ChatCompletionRequest)


def parse_request(body: bytes, model: type[RequestT]) -> RequestT:
    """Parse a raw JSON body into `model` and check it is supported; every failure is a 400,
    a body nested too deep to decode included (the decoder's RecursionError, never a 500)."""
    request = parse_object(body, model)
    request.check_supported()
    return request
