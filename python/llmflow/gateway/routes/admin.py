"""The admin routes: Prometheus metrics, the state snapshot, and the live dashboard.

They show every tenant's traffic, so they can be fenced off: with `admin.api_key` set each
needs that key, and with `admin.port` set they leave the main listener for one of their own
(`create_admin_app`). The default serves them on the main listener, open, as a loopback
gateway needs.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse, Response

from llmflow.gateway.dashboard import PAGE
from llmflow.gateway.metrics import CONTENT_TYPE
from llmflow.gateway.routes.deps import admin, gateway

__all__ = ["router"]

router = APIRouter(tags=["admin"], dependencies=[Depends(admin)])


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus text exposition."""
    return Response(gateway(request).metrics.render(), media_type=CONTENT_TYPE)


@router.get("/api/state")
async def state(request: Request) -> dict[str, Any]:
    """Queue by tier, in flight, per-backend KV usage, per-request KV footprint, live streams."""
    return gateway(request).state()


@router.get("/dashboard", response_class=HTMLResponse)
async def dashboard() -> HTMLResponse:
    """The live KV-occupancy page."""
    return HTMLResponse(PAGE)
