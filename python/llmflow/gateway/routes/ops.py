"""Operational routes: Prometheus metrics, liveness, readiness, and the state snapshot."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from llmflow.gateway.metrics import CONTENT_TYPE
from llmflow.gateway.routes.deps import gateway

__all__ = ["router"]

router = APIRouter(tags=["operations"])


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus text exposition."""
    return Response(gateway(request).metrics.render(), media_type=CONTENT_TYPE)


@router.get("/healthz")
@router.get("/health", include_in_schema=False)  # vLLM's name: clients and routers probe it
async def healthz() -> dict[str, str]:
    """Liveness: the process serves HTTP."""
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(request: Request) -> JSONResponse:
    """Readiness: not draining and at least one healthy backend (503 otherwise)."""
    gw = gateway(request)
    healthy = [n for n, s in gw.scraper.states.items() if s.healthy] if gw.scraper else []
    ready = bool(healthy) and not gw.draining
    body = {
        "status": "ready" if ready else "unavailable",
        "draining": gw.draining,
        "healthy_backends": healthy,
    }
    return JSONResponse(body, status_code=200 if ready else 503)


@router.get("/api/state")
async def state(request: Request) -> dict[str, Any]:
    """Queue by tier, in flight, per-backend KV usage, per-request KV footprint, live streams."""
    return gateway(request).state()
