"""Wire models of the OpenAI surface: what a request must look like before it reaches a backend.

Known fields are checked strictly (a string where a number belongs is a 400, never coerced);
unknown fields are kept, so vLLM's own extensions (`ignore_eos`, `top_k`, ...) pass through.
Responses are built as plain dicts on the hot path; `ModelList` documents `/v1/models`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "ModelCard",
    "ModelList",
    "StreamOptions",
]


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Open):
    """`stream_options`: whether the client wants token usage in the stream."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class ChatMessage(_Open):
    """One chat message; `content` is a string or a list of typed parts."""

    role: str
    content: str | list[dict[str, Any]] | None = None


class _Sampling(_Open):
    model: str = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None


class ChatCompletionRequest(_Sampling):
    """Body of `POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


class CompletionRequest(_Sampling):
    """Body of `POST /v1/completions`: one prompt, as text or token ids."""

    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False


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
