"""The OpenAI-compatible routes: completions, chat completions, models."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from llmflow.gateway.auth import Identity  # noqa: TC001 - FastAPI resolves it at runtime
from llmflow.gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    request_body,
)
from llmflow.gateway.routes.deps import gateway, identity, service
from llmflow.gateway.signals import read_signals
from llmflow.gateway.sse import SessionStream

if TYPE_CHECKING:
    from llmflow.gateway.types import Endpoint

__all__ = ["router"]

router = APIRouter(prefix="/v1", tags=["openai"])


@router.post("/chat/completions", openapi_extra=request_body(ChatCompletionRequest))
async def chat_completions(request: Request) -> Response:
    """Create a chat completion (streamed as SSE when `stream` is true)."""
    return await _complete("chat", request)


@router.post("/completions", openapi_extra=request_body(CompletionRequest))
async def completions(request: Request) -> Response:
    """Create a text completion (streamed as SSE when `stream` is true)."""
    return await _complete("completions", request)


@router.get("/models")
async def models(request: Request, _who: Annotated[Identity, Depends(identity)]) -> ModelList:
    """The models the configured backends serve."""
    gw = gateway(request)
    created = int(time.time() - (time.monotonic() - gw.started_at))
    return ModelList(
        data=[
            ModelCard(id=name, created=created, max_model_len=length)
            for name, length in sorted(gw.models.items())
        ]
    )


async def _complete(endpoint: Endpoint, request: Request) -> Response:
    svc, settings = service(request), gateway(request).settings
    prepared = svc.prepare(endpoint, identity(request), await request.body())
    prepared.traceparent = request.headers.get("traceparent")  # continued by its span
    prepared.signals = read_signals(request.headers.raw)
    session = await svc.serve(prepared, request.receive)
    if not prepared.options.stream:
        return JSONResponse(session.response(), headers=session.reply_headers)
    return SessionStream(session, settings.streaming.sse_flush_interval / 1e3)
