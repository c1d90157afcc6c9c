"""Operational routes on the main listener: liveness and readiness (the rest is `admin.py`)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from llmflow.gateway.routes.deps import gateway

__all__ = ["router"]

router = APIRouter(tags=["operations"])


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
