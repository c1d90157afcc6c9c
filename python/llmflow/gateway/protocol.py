"""Wire models of the OpenAI surface: what a request must look like before it reaches a backend.

Bodies are decoded by `decode_json` alone, strictly (RFC 8259: UTF-8, no NaN or Infinity, no
lone surrogates, bounded nesting and number size), so whatever a client sends is either a plain
JSON object every later step can handle or a 400 that says what to fix. Known fields are checked
strictly (a string where a number belongs is a 400, never coerced); unknown fields are kept, so
vLLM's own extensions (`ignore_eos`, `top_k`, ...) pass through. Responses are built as plain
dicts on the hot path; `ModelList` documents `/v1/models`.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import models_json_schema
from pydantic_core import from_json

from llmflow._core import json_refusal
from llmflow.gateway.errors import GatewayError

if TYPE_CHECKING:
    from fastapi import FastAPI

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "ModelCard",
    "ModelList",
    "ResponsesRequest",
    "StreamOptions",
    "decode_json",
    "install_schemas",
    "request_body",
]

MAX_INT = 2**31 - 1  # largest token count or choice count a request may name (vLLM's int32)
# A number that may overflow a float to +-inf: it needs integer digits plus exponent past 308,
# so an exponent of 2+ digits or 300+ digits in a row (the core decides: `json_refusal`).
_MAYBE_HUGE = re.compile(rb"[0-9][eE][+]?[0-9]{2}|[0-9]{300}")


def decode_json(raw: bytes) -> dict[str, Any]:
    """Decode a request body: one JSON object, strictly, or a 400 naming what to fix.

    This is the one place a client's JSON is parsed (HTTP bodies and WebSocket messages), so
    the whole class of parser-exhausting input stops here: deep nesting, numbers too long to
    convert, invalid UTF-8, lone surrogates, `NaN`/`Infinity` (not JSON), numbers that
    overflow a float, and a top level that is not an object. A refusal is worded by the core
    (`json_refusal`, which the native front answers with too), so its line and column are the
    same on both paths whichever jiter this pydantic-core was built with.

    Args:
        raw: the body as received.

    Returns:
        The object, every string valid Unicode and every number finite.

    Raises:
        GatewayError: 400 `invalid_json`, its message saying where and what to change.
    """
    body: dict[str, Any] | object
    try:
        body = from_json(raw, allow_inf_nan=False, cache_strings=False)
    except ValueError as exc:
        body = exc
    if isinstance(body, dict) and not _MAYBE_HUGE.search(raw):
        return body
    message = json_refusal(raw)  # the core's walk also finds a float that overflowed
    if message is None and isinstance(body, dict):
        return body
    if message is None:  # not reached while this pydantic-core's jiter and the core's agree
        message = f"request body is not valid JSON: {body}"
    raise GatewayError(400, message, "invalid_json")


TokenId = Annotated[int, Field(ge=0, le=MAX_INT)]


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


class StreamOptions(_Open):
    """`stream_options`: whether the client wants token usage in the stream."""

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class ChatMessage(_Open):
    """One chat message; `content` is a string or a list of typed parts."""

    role: str
    content: str | list[dict[str, Any]] | None = None


class _Sampling(_Open):
    # Nullable where vLLM's own models are (`"stream": null` is `false`, as there).
    model: str = Field(min_length=1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | Annotated[list[str], Field(max_length=4)] | None = None  # vLLM's bound
    seed: int | None = None
    user: str | None = None

    @property
    def streamed(self) -> bool:
        """Whether the client asked for SSE (`null` is no)."""
        return bool(self.stream)


class ChatCompletionRequest(_Sampling):
    """Body of `POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT)
    n: int | None = Field(1, ge=1, le=MAX_INT)  # the gateway's own bound is `limits.max_n`


class CompletionRequest(_Sampling):
    """Body of `POST /v1/completions`: a prompt as text or token ids, or a batch of either.

    `max_tokens` may be 0 with `echo` (vLLM then returns the prompt alone, as scorers ask).
    """

    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    max_tokens: int | None = Field(None, ge=0, le=MAX_INT)
    n: int = Field(1, ge=1, le=MAX_INT)
    echo: bool | None = False

    @property
    def prompts(self) -> list[str] | list[list[int]]:
        """The prompts of the request: one, or each of a batch."""
        prompt: Any = self.prompt
        if isinstance(prompt, str) or not (prompt and isinstance(prompt[0], str | list)):
            return [prompt]  # one prompt: text, or token ids
        return list(prompt)


class ResponsesRequest(_Open):
    """Body of `POST /v1/responses` (the fields the gateway reads; the rest pass through)."""

    model: str = Field(min_length=1)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_INT)
    stream: bool | None = False


class ModelCard(BaseModel):
    """One entry of `/v1/models`."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "llmflow"
    max_model_len: int


class ModelList(BaseModel):
    """Body of `GET /v1/models`."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """A route's `openapi_extra`: its JSON body is `model` (the route reads the raw bytes)."""
    schema = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


# The governed generation routes, which the native front door serves (the app has no route
# for them): path -> (tag, summary, description, request model), as the app's own were.
_FRONT_ROUTES: dict[str, tuple[str, str, str, type[BaseModel]]] = {
    "/v1/chat/completions": (
        "openai",
        "Chat Completions",
        "Create a chat completion (streamed as SSE when `stream` is true).",
        ChatCompletionRequest,
    ),
    "/v1/completions": (
        "openai",
        "Completions",
        "Create a text completion (streamed as SSE when `stream` is true).",
        CompletionRequest,
    ),
    "/v1/responses": (
        "vllm",
        "Responses",
        "Create a model response (streamed as SSE events when `stream` is true).",
        ResponsesRequest,
    ),
}


def _front_operation(path: str) -> dict[str, Any]:
    tag, summary, description, model = _FRONT_ROUTES[path]
    name = path.strip("/").replace("/", "_")
    return {
        "tags": [tag],
        "summary": summary,
        "description": description,
        "operationId": f"{name.removeprefix('v1_')}_{name}_post",
        **request_body(model),
        "responses": {
            "200": {
                "description": "Successful Response",
                "content": {"application/json": {"schema": {}}},
            }
        },
    }


def install_schemas(app: FastAPI) -> None:
    """Publish the request models in the app's OpenAPI schema, and the routes the native front
    door serves, so `/docs` shows every route a client may call."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            _, defs = models_json_schema(
                [
                    (ChatCompletionRequest, "validation"),
                    (CompletionRequest, "validation"),
                    (ResponsesRequest, "validation"),
                ],
                ref_template="#/components/schemas/{model}",
            )
            schema.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
            paths = schema.setdefault("paths", {})
            for path in _FRONT_ROUTES:
                paths.setdefault(path, {})["post"] = _front_operation(path)
        return app.openapi_schema or {}

    app.openapi = openapi  # type: ignore[method-assign]
