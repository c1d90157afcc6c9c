"""The OpenAI-compatible routes: completions, chat completions, models."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from llmflow.gateway.auth import Identity  # noqa: TC001 - FastAPI resolves it at runtime
from llmflow.gateway.protocol import ModelCard, ModelList
from llmflow.gateway.routes.deps import gateway, identity, service
from llmflow.gateway.serving import CompletionService  # noqa: TC001 - as above
from llmflow.gateway.sse import SessionStream

if TYPE_CHECKING:
    from llmflow.gateway.types import Endpoint

__all__ = ["router"]

router = APIRouter(prefix="/v1", tags=["openai"])
_BODY = {"requestBody": {"required": True, "content": {"application/json": {}}}}


@router.post("/chat/completions", openapi_extra=_BODY)
async def chat_completions(
    request: Request,
    who: Annotated[Identity, Depends(identity)],
    svc: Annotated[CompletionService, Depends(service)],
) -> Response:
    """Create a chat completion (streamed as SSE when `stream` is true)."""
    return await _complete("chat", request, who, svc)


@router.post("/completions", openapi_extra=_BODY)
async def completions(
    request: Request,
    who: Annotated[Identity, Depends(identity)],
    svc: Annotated[CompletionService, Depends(service)],
) -> Response:
    """Create a text completion (streamed as SSE when `stream` is true)."""
    return await _complete("completions", request, who, svc)


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


async def _complete(
    endpoint: Endpoint, request: Request, who: Identity, svc: CompletionService
) -> Response:
    prepared = svc.prepare(endpoint, who, await request.body())
    result = await svc.serve(prepared, request.receive)
    if isinstance(result, dict):
        return JSONResponse(result)
    streaming = gateway(request).settings
    return SessionStream(
        result,
        streaming.streaming.sse_flush_interval / 1e3,
        streaming.backpressure.stall_timeout_ms / 1e3,
    )
