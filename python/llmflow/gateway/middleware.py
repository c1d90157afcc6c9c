"""Plain ASGI middleware: the request body's size and encoding, and a keyless gateway's Host and
Origin, refused as OpenAI-style errors; behind the native front door, the client's address."""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmflow._core import front_foreign_request
from llmflow.gateway.contract import reason_header
from llmflow.gateway.errors import GatewayError, error_bytes

if TYPE_CHECKING:
    from collections.abc import Iterable

    from llmflow.gateway.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["BodyLimit", "HostGuard", "PeerFromFront", "foreign_request"]

PEER_HEADER = b"x-llmflow-peer"  # the client's address, from the native front door


def foreign_request(
    host: bytes | None, origin: bytes | None, allowed: frozenset[str]
) -> str | None:
    """Why a keyless gateway must not answer a request with this Host and Origin, or None.

    With no key, anything that can reach the port may use it, and a browser will reach a
    loopback port for any page it shows. DNS rebinding points a page's own name at 127.0.0.1:
    its requests then carry that name as Host, so a Host that is neither an IP literal nor a
    name the gateway is known by (`allowed`) is refused. A cross-site page sends its own
    Origin with a POST or a WebSocket upgrade, so an Origin whose host and port are not the
    request's Host is refused. Same-origin pages (the dashboard, the playground) send an
    Origin equal to their Host, and tools send none.

    The rule is the core's (`front/origin.rs`), which the native front door answers its own
    routes with, so the app and the front refuse the same requests with the same words.
    """
    return front_foreign_request(host, origin, allowed)


def allowed_host_names(configured: Iterable[str]) -> frozenset[str]:
    """The names a keyless gateway answers on: `localhost`, its listen host, the configured."""
    return frozenset(n.lower() for n in ("localhost", *configured) if n)


class HostGuard:
    """A keyless gateway answers only its own Host and same-origin pages (403 otherwise).

    Applies to HTTP requests and WebSocket upgrades alike; a gateway with API keys is left
    alone (a page cannot send the key cross-site). See `foreign_request`.

    Args:
        app: the wrapped ASGI app.
        allowed: host names answered besides IP literals (`allowed_host_names`).
    """

    def __init__(self, app: ASGIApp, allowed: frozenset[str]) -> None:
        self.app = app
        self.allowed = allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Refuse a foreign Host or Origin; pass everything else on."""
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        host = origin = None
        for name, value in scope["headers"]:
            if name == b"host" and host is None:
                host = value
            elif name == b"origin" and origin is None:
                origin = value
        reason = foreign_request(host, origin, self.allowed)
        if reason is None:
            await self.app(scope, receive, send)
        elif scope["type"] == "http":
            await _send_error(send, 403, reason, "forbidden_origin")
        elif "websocket.http.response" in (scope.get("extensions") or {}):
            await _send_error(send, 403, reason, "forbidden_origin", "websocket.http.response")
        else:
            await send({"type": "websocket.close", "code": 1008})


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


async def _send_error(
    send: Send, status: int, message: str, code: str, kind: str = "http.response"
) -> None:
    body = error_bytes(status, message, code)
    await send(
        {
            "type": f"{kind}.start",
            "status": status,
            "headers": [
                reason_header(code),
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": f"{kind}.body", "body": body})


class PeerFromFront:
    """Behind the native front door: the client's address from the front's `x-llmflow-peer`.

    uvicorn serves the app on a private unix socket there (`gateway/front.py`), so the scope
    has no client address of its own; the front sends the client's `IP:PORT` on every request
    (dropping one a client sent), and this makes it the scope's `client` and removes the
    header, so the app sees the request as it would on the port. The header is trusted only
    because nothing but the front can reach that socket.

    Args:
        app: the wrapped ASGI app.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Set `client` from the header, then pass the request on."""
        if scope["type"] in ("http", "websocket"):
            headers = scope["headers"]
            for i in range(len(headers) - 1, -1, -1):  # the front appends it: last
                if headers[i][0] == PEER_HEADER:
                    host, _, port = headers[i][1].decode("latin-1").rpartition(":")
                    client = (host.strip("[]"), int(port)) if port.isdigit() else None
                    scope = {**scope, "client": client, "headers": headers[:i] + headers[i + 1 :]}
                    break
        await self.app(scope, receive, send)
