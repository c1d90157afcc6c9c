"""The WebSocket acknowledgement protocol: a browser renders, acknowledges, and so paces us.

The server never has more than `client_window` chunks unacknowledged. While the client lags,
chunks pile up in the session's bounded window (so the reader stops reading upstream when it
fills) and go out merged once the client catches up. Owing the client a full window is the
session's "window full" for the runtime, an ack that makes room its "drained"; a client that
stays full for the stall timeout is cut by the runtime's stall timer. The wire format is in
`docs/protocol-websocket.md`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import TYPE_CHECKING, Any

from starlette.websockets import WebSocketDisconnect

from llmflow.gateway.errors import GatewayError
from llmflow.gateway.protocol import decode_json
from llmflow.gateway.serving import ClientGone, Departure
from llmflow.gateway.streaming import merge_chunks, parse_item

if TYPE_CHECKING:
    from starlette.websockets import WebSocket

    from llmflow.gateway.auth import Identity, KeyRing
    from llmflow.gateway.serving import CompletionService
    from llmflow.gateway.session import StreamSession
    from llmflow.gateway.streaming import Item
    from llmflow.gateway.types import Json

__all__ = ["AckChannel", "FrameRedactor", "serve_websocket"]

_ENDPOINTS = ("chat", "completions")


class FrameRedactor(logging.Filter):
    """Keep WebSocket payloads out of debug logs: a request message may carry an API key.

    The `websockets` library logs every frame it sends and receives (`< TEXT '...'`) at DEBUG
    on the logger uvicorn gives it; this keeps the frame's kind and size and drops its data.
    `llmflow serve` installs it on that logger.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        """Rewrite a frame record's arguments to their kind and size; keep every record."""
        if record.msg in ("< %s", "> %s") and isinstance(record.args, tuple):
            record.args = tuple(_frame_summary(arg) for arg in record.args)
        return True


def _frame_summary(frame: Any) -> str:
    opcode = getattr(getattr(frame, "opcode", None), "name", "frame")
    data = getattr(frame, "data", b"")
    return f"{opcode} [{len(data)} bytes, not logged]"


class AckChannel:
    """Client-to-server messages of one socket: acks, cancels, requests, and the close.

    Args:
        websocket: an accepted socket.
    """

    def __init__(self, websocket: WebSocket) -> None:
        self.websocket = websocket
        self.acked = 0  # highest sequence number the client has acknowledged
        self.current: Any = None  # id of the request being streamed
        self.departure = Departure()  # the socket closed, or the client cancelled
        self.closed = False
        self.requests: asyncio.Queue[Json] = asyncio.Queue()
        self.stalled = False  # the runtime cut the current request: the client owes too much
        self._progress = asyncio.Event()

    async def run(self) -> None:
        """Read client messages until the socket closes.

        Each message is decoded as strictly as an HTTP body; one that is not a JSON object is
        a protocol violation: the client gets an `error` saying why, and the socket closes.
        """
        try:
            while True:
                frame = await self.websocket.receive()
                if frame["type"] == "websocket.disconnect":
                    break
                text = frame.get("text")
                raw = text.encode() if text is not None else frame.get("bytes") or b""
                try:
                    message = decode_json(raw)
                except GatewayError as exc:
                    await _send(self.websocket, _error_message(None, exc))
                    await self.websocket.close(code=1003)
                    break
                self._on(message)
        except (WebSocketDisconnect, RuntimeError, ClientGone):
            pass
        self.closed = True
        self.departure.leave()
        self._progress.set()

    def _on(self, message: Json) -> None:
        kind = message.get("type")
        if kind == "ack" and isinstance(message.get("seq"), int):
            if message.get("id", self.current) != self.current:
                return  # a late ack for an earlier request
            self.acked = max(self.acked, message["seq"])
            self._progress.set()
        elif kind == "cancel":
            self.departure.leave()
            self._progress.set()
        elif kind == "request":
            self.requests.put_nowait(message)

    def stall(self) -> None:
        """The runtime cut the current request for a stalled client: stop waiting for acks."""
        self.stalled = True
        self._progress.set()

    async def room(self, sent: int, window: int, session: StreamSession) -> bool:
        """Wait until fewer than `window` chunks are unacknowledged; False if stalled or gone.

        While the client owes a full window the session's window counts as full, so the
        runtime's stall timer runs.
        """
        owing = sent - self.acked >= window
        if owing:
            session.window_full()
        while sent - self.acked >= window:
            if self.departure.left or self.stalled:
                return False
            self._progress.clear()
            await self._progress.wait()
        if owing:
            session.window_drained()
        return not self.departure.left


async def serve_websocket(
    websocket: WebSocket,
    service: CompletionService,
    keyring: KeyRing,
    window: int,
) -> None:
    """Serve one socket: requests one at a time, each streamed under the ack window.

    Args:
        websocket: the socket (not yet accepted).
        service: the completion service.
        keyring: resolves API keys (header, or `api_key` in the request message).
        window: the most unacknowledged chunks (`backpressure.client_window`).
    """
    await websocket.accept()
    channel = AckChannel(websocket)
    reader = asyncio.create_task(channel.run())
    header = websocket.headers.get("authorization")
    try:
        while not channel.closed:
            getter = asyncio.create_task(channel.requests.get())
            await asyncio.wait([getter, reader], return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                break
            await _one_request(
                websocket,
                channel,
                service,
                keyring,
                header,
                window,
                getter.result(),
            )
    finally:
        reader.cancel()
        await asyncio.wait([reader])


async def _one_request(
    websocket: WebSocket,
    channel: AckChannel,
    service: CompletionService,
    keyring: KeyRing,
    header: str | None,
    window: int,
    message: Json,
) -> None:
    request_id = message.get("id")
    channel.acked, sent, channel.current, channel.stalled = 0, 0, request_id, False
    if not channel.closed:
        channel.departure = Departure()
    session: StreamSession | None = None
    try:
        identity = _identity(keyring, header, message)
        endpoint = message.get("endpoint", "chat")
        if endpoint not in _ENDPOINTS or not isinstance(message.get("body"), dict):
            raise GatewayError(
                400,
                "a request needs 'endpoint' (chat or completions) and a 'body' object",
                "invalid_request",
            )
        body = {**message["body"], "stream": True}
        prepared = service.prepare(endpoint, identity, json.dumps(body).encode())
        session = service.admit(prepared)
        session.cancel_writer = channel.stall
        await channel.departure.run(session.start())
        if session.error is not None:
            raise session.error
        start = {"type": "start", "id": request_id, "window": window}
        await _send(websocket, {**start, "request_id": session.request_id})  # /api/state's id
        carry: list[Item] = []  # taken from the session but not yet sent: at most 2 windows
        while carry or (carry := await session.window.take()):
            if not await channel.room(sent, window, session):
                if channel.stalled:  # cut for owing acks too long: it reads this once it renders
                    await _send(websocket, _end(request_id, session.end, sent))
                return
            carry = merge_chunks(carry + session.window.take_nowait())
            allowed = window - (sent - channel.acked)
            for chunk in carry[:allowed]:
                sent += 1
                await _send(
                    websocket,
                    {"type": "chunk", "id": request_id, "seq": sent, "data": parse_item(chunk)},
                )
            carry = carry[allowed:]
        await _send(websocket, _end(request_id, session.end, sent))
    except ClientGone:
        return
    except GatewayError as exc:
        with contextlib.suppress(ClientGone):  # the socket may have closed meanwhile
            await _send(websocket, _error_message(request_id, exc))
    finally:
        if session is not None:
            session.cancel_writer = None
            await session.close()


def _identity(keyring: KeyRing, header: str | None, message: Json) -> Identity:
    key = message.get("api_key")
    return keyring.authenticate(header or (f"Bearer {key}" if isinstance(key, str) else None))


def _end(request_id: Any, reason: str, sent: int) -> Json:
    return {"type": "end", "id": request_id, "reason": reason, "sent": sent}


def _error_message(request_id: Any, exc: GatewayError) -> Json:
    value = exc.headers.get("Retry-After")
    retry = {"retry_after": int(value)} if value else {}
    return {"type": "error", "id": request_id, "status": exc.status, **exc.body, **retry}


async def _send(websocket: WebSocket, message: Json) -> None:
    try:
        await websocket.send_text(json.dumps(message, separators=(",", ":")))
    except (WebSocketDisconnect, RuntimeError, OSError):
        raise ClientGone from None
