"""Plain ASGI middleware: the request body's size and encoding, refused as OpenAI-style errors."""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmflow.gateway.errors import GatewayError, error_bytes

if TYPE_CHECKING:
    from llmflow.gateway.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["BodyLimit"]


class BodyLimit:
    """Refuse request bodies larger than `max_bytes` with 413, before they are read whole.

    A declared `Content-Length` over the limit is refused at once; a chunked body is counted as
    it arrives and refused when it passes the limit. A compressed body (`Content-Encoding`
    other than `identity`) is refused with 415: the gateway decodes none, so no gzip bomb can
    expand in it, and the client learns to send plain JSON instead of a parse error.

    Args:
        app: the wrapped ASGI app.
        max_bytes: the largest body accepted (`server.max_body_bytes`).
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Check the declared length, then count the body as the app reads it."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                await _send_error(send, 413, _message(self.max_bytes), "body_too_large")
                return
            if name == b"content-encoding" and value.strip().lower() not in (b"", b"identity"):
                encoding = value.decode("latin-1")[:40]
                message = f"Content-Encoding {encoding!r} is not supported: send plain JSON"
                await _send_error(send, 415, message, "unsupported_content_encoding")
                return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise GatewayError(413, _message(self.max_bytes), "body_too_large")
            return message

        await self.app(scope, counted, send)


def _message(limit: int) -> str:
    return f"request body is larger than the gateway's limit of {limit} bytes"


async def _send_error(send: Send, status: int, message: str, code: str) -> None:
    body = error_bytes(status, message, code)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
