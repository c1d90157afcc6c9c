"""The WebSocket route of the acknowledgement protocol (`docs/protocol-websocket.md`)."""

from __future__ import annotations

from fastapi import APIRouter, WebSocket

from llmflow.gateway.ws import serve_websocket

__all__ = ["router"]

router = APIRouter(prefix="/v1", tags=["websocket"])


@router.websocket("/ws")
async def stream_ws(websocket: WebSocket) -> None:
    """Stream completions with explicit acknowledgements (at most `client_window` unacked)."""
    gw = websocket.app.state.gateway
    settings = gw.settings
    await serve_websocket(
        websocket,
        gw.service,
        gw.keyring,
        settings.backpressure.client_window,
        settings.server.ws_idle_timeout_ms / 1e3,
    )
