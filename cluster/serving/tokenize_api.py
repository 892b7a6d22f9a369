"""`POST /tokenize`, `POST /detokenize` and `GET /tokenizer_info` in vLLM's shapes: the served
model's own tokenizer and chat template, over HTTP, for clients that count or evaluate with it
(lm-eval's `local-completions` with `tokenizer_backend=auto` probes `/tokenizer_info` and
`/tokenize`, then tokenizes and detokenizes through them).

- `{"prompt", "add_special_tokens": true}` -> `{"count", "max_model_len", "tokens"}`: the ids a
  completions prompt gets.
- `{"messages", "add_generation_prompt": true, "add_special_tokens": false, "tools"}` -> the
  same: the chat request rendered once through the chat path (`chat_bridge.render_only`), as
  `/v1/chat/completions` would send it to the engine.
- `return_token_strs: true` adds `token_strs`, each id's token text.
- `{"tokens"}` -> `{"prompt"}`: the ids decoded, special tokens kept.

Invariants: `model` may be left out (the served model); a name the server does not serve is a
404. Bad input is a 400 in OpenAI's body naming the field. As in vLLM these routes sit outside
`/v1` and need no API key: they read only the tokenizer, never the cache or the engines.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from cluster.engine.errors import RequestRejected
from cluster.serving.chat_bridge import ParamNames, render_only
from cluster.serving.error_map import ANSWERED, http_error
from cluster.serving.http_api import HttpIngress
from cluster.serving.limits import read_body
from cluster.serving.openai_protocol import invalid_request, parse_object
from cluster.serving.openai_requests import ChatMessage
from cluster.serving.openai_serving import OpenAIServing
from cluster.serving.openapi_schema import request_body
from cluster.serving.tool_calls import ToolDef

SAME_NAMES = ParamNames(())
"""The chat fields of a `/tokenize` body are named as in chat completions."""


class _Edge(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TokenizeCompletionRequest(_Edge):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Edge):
    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    tools: list[ToolDef] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Edge):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


def parse_tokenize_request(body: bytes) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """A chat body when it has `messages`, else a completions body (400 naming the field)."""
    try:
        is_chat = isinstance(decoded := json.loads(body), dict) and "messages" in decoded
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        is_chat = False  # parse_object says what is wrong with it
    model = TokenizeChatRequest if is_chat else TokenizeCompletionRequest
    return parse_object(body, model)


class TokenizerServing:
    """Tokenizes and detokenizes with the front end's renderer."""

    def __init__(self, openai: OpenAIServing, max_model_len: int) -> None:
        self.openai = openai
        self.max_model_len = max_model_len

    async def check_model(self, model: str | None) -> None:
        if model is None:
            return
        try:
            await self.openai.frontend.adapters.resolve(model)
        except ANSWERED as error:
            raise http_error(error) from None

    def tokenize(self, request: TokenizeCompletionRequest | TokenizeChatRequest) -> dict:
        """vLLM's tokenize answer (runs on the front end's threads)."""
        renderer = self.openai.frontend.renderer
        if isinstance(request, TokenizeChatRequest):
            fields = request.model_dump(include={"messages", "tools"}, exclude_none=True)
            fields["model"] = request.model or self.openai.model
            rendered = render_only(
                self.openai,
                fields,
                SAME_NAMES,
                add_generation_prompt=request.add_generation_prompt,
                add_special_tokens=request.add_special_tokens,
            )
            tokens = rendered.token_ids
        elif request.prompt:
            try:
                tokens = renderer.encode(request.prompt, request.add_special_tokens)
            except RequestRejected:  # only whitespace the tokenizer drops
                tokens = []
        else:
            tokens = []
        answer: dict[str, Any] = {
            "count": len(tokens),
            "max_model_len": self.max_model_len,
            "tokens": tokens,
        }
        if request.return_token_strs:
            answer["token_strs"] = renderer.tokenizer.convert_ids_to_tokens(tokens)
        return answer

    def detokenize(self, request: DetokenizeRequest) -> dict[str, str]:
        renderer = self.openai.frontend.renderer
        for index, token in enumerate(request.tokens):
            if token >= renderer.vocab_size:
                raise invalid_request(
                    f"tokens[{index}] is {token}, not a token id in [0, {renderer.vocab_size})",
                    f"tokens[{index}]",
                )
        return {"prompt": renderer.decode(request.tokens, skip_special_tokens=False)}

    def tokenizer_info(self) -> dict[str, Any]:
        """What a client needs to tokenize and template as the server does (vLLM's fields)."""
        tokenizer = self.openai.frontend.renderer.tokenizer
        return {
            "tokenizer_class": type(tokenizer).__name__,
            "eos_token": tokenizer.eos_token,
            "bos_token": tokenizer.bos_token,
            "pad_token": tokenizer.pad_token,
            "unk_token": tokenizer.unk_token,
            "chat_template": tokenizer.chat_template,
            "model_max_length": self.max_model_len,
        }


def install_tokenizer_routes(api: FastAPI, ingress: HttpIngress) -> None:
    """`/tokenize`, `/detokenize` and `/tokenizer_info` over `ingress`'s front end."""
    serving = TokenizerServing(ingress.openai, ingress.frontend.max_model_len)
    off_loop = ingress.frontend.off_loop
    max_body_bytes = ingress.args.limits.max_body_bytes

    @api.post("/tokenize", openapi_extra=request_body(TokenizeCompletionRequest))
    async def tokenize(request: Request) -> JSONResponse:
        parsed = await off_loop(parse_tokenize_request, await read_body(request, max_body_bytes))
        await serving.check_model(parsed.model)
        return JSONResponse(await off_loop(serving.tokenize, parsed))

    @api.post("/detokenize", openapi_extra=request_body(DetokenizeRequest))
    async def detokenize(request: Request) -> JSONResponse:
        body = await read_body(request, max_body_bytes)
        parsed = await off_loop(parse_object, body, DetokenizeRequest)
        await serving.check_model(parsed.model)
        return JSONResponse(await off_loop(serving.detokenize, parsed))

    @api.get("/tokenizer_info")
    async def tokenizer_info() -> JSONResponse:
        return JSONResponse(serving.tokenizer_info())
