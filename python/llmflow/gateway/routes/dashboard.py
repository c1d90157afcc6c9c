"""The dashboard route: the live KV-occupancy page (it polls `/api/state`)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

from llmflow.gateway.dashboard import PAGE

__all__ = ["router"]

router = APIRouter(tags=["dashboard"])


@router.get("/dashboard", response_class=HTMLResponse)
async def dashboard() -> HTMLResponse:
    """The live KV-occupancy page."""
    return HTMLResponse(PAGE)
