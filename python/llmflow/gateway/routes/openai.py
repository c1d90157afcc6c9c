"""The OpenAI-compatible routes the app serves: the model list.

The generation routes (`/v1/chat/completions`, `/v1/completions`) are the native front door's
(`rust/src/front/`), which serves every HTTP request to them; the app's OpenAPI document still
describes them (`protocol.install_schemas`).
"""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, Depends, Request

from llmflow.gateway.auth import Identity  # noqa: TC001 - FastAPI resolves it at runtime
from llmflow.gateway.protocol import ModelCard, ModelList
from llmflow.gateway.routes.deps import gateway, identity

__all__ = ["router"]

router = APIRouter(prefix="/v1", tags=["openai"])


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
