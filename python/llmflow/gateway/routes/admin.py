"""The admin routes: Prometheus metrics, the state snapshot, and the live dashboard.

They show every tenant's traffic, so they can be fenced off: with `admin.api_key` set each
needs that key, and with `admin.port` set they leave the main listener for one of their own
(`create_admin_app`). The default serves them on the main listener, open, as a loopback
gateway needs.
"""

from __future__ import annotations

import json

from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from llmflow.gateway.dashboard import PAGE
from llmflow.gateway.metrics import CONTENT_TYPE
from llmflow.gateway.routes.deps import admin, gateway

__all__ = ["router"]

router = APIRouter(tags=["admin"], dependencies=[Depends(admin)])


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus text exposition."""
    g = gateway(request)
    return Response(g.metrics.render(), media_type=CONTENT_TYPE)


@router.get("/api/state", response_class=JSONResponse)
async def state(request: Request) -> Response:
    """Queue by tier, in flight, per-backend KV usage, per-request KV footprint, live streams."""
    # Encoded here, as `JSONResponse` would, but without FastAPI's generic encoder first: the
    # state is plain JSON already, and that encoder's walk over every request took ~26 ms of
    # the event loop per dashboard poll at 1,000 requests in flight, `json.dumps` ~3 ms
    # (docs/benchmarks.md, "Dashboard").
    body = json.dumps(
        gateway(request).state(), ensure_ascii=False, allow_nan=False, separators=(",", ":")
    )
    return Response(body.encode(), media_type="application/json")


@router.get("/dashboard", response_class=HTMLResponse)
async def dashboard() -> HTMLResponse:
    """The live KV-occupancy page."""
    return HTMLResponse(PAGE)
