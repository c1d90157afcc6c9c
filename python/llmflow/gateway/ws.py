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
import base64
import binascii
import contextlib
import json
import logging
from typing import TYPE_CHECKING, Any

from starlette.websockets import WebSocketDisconnect

from llmflow.gateway.contract import TRANSPORT_RETRY_AFTER_S
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

__all__ = ["PROTOCOL", "AckChannel", "FrameRedactor", "key_subprotocol", "serve_websocket"]

_ENDPOINTS = ("chat", "completions")
PROTOCOL = "llmflow.v1"  # the subprotocol a browser offers, and the server accepts with
_KEY_PREFIX = "llmflow.key."  # a browser's key: "llmflow.key." + base64url(KEY), no padding
MAX_PENDING = 2  # requests a socket may send ahead of the one being streamed
MAX_ID_CHARS = 128  # a request id is echoed in every frame: a string of at most this, or an int
# Headers the websockets library logs at DEBUG during the handshake that carry a secret.
_SECRET_HEADERS = frozenset({"authorization", "proxy-authorization", "cookie", "set-cookie"})


def key_subprotocol(key: str) -> str:
    """The subprotocol that carries `key` for a browser (which cannot set headers)."""
    return _KEY_PREFIX + base64.urlsafe_b64encode(key.encode()).decode().rstrip("=")


class FrameRedactor(logging.Filter):
    """Keep WebSocket payloads and handshake secrets out of debug logs.

    The `websockets` library logs every frame it sends and receives (`< TEXT '...'`) and every
    handshake header (`< authorization: Bearer ...`) at DEBUG on the logger uvicorn gives it.
    This keeps a frame's kind and size and drops its data, and replaces the value of a header
    that carries a key (`Authorization`, cookies, and `Sec-WebSocket-Protocol`, where a browser
    puts its key) with its length. `llmflow serve` installs it on that logger.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        """Rewrite a frame or secret header record's arguments; keep every record."""
        if not isinstance(record.args, tuple):
            return True
        if record.msg in ("< %s", "> %s"):
            record.args = tuple(_frame_summary(arg) for arg in record.args)
        elif record.msg in ("< %s: %s", "> %s: %s") and len(record.args) == 2:
            name, value = record.args
            lowered = str(name).lower()
            if lowered in _SECRET_HEADERS or lowered == "sec-websocket-protocol":
                record.args = (name, f"[{len(str(value))} characters, not logged]")
        return True


def _frame_summary(frame: Any) -> str:
    opcode = getattr(getattr(frame, "opcode", None), "name", "frame")
    data = getattr(frame, "data", b"")
    return f"{opcode} [{len(data)} bytes, not logged]"


class AckChannel:
    """Client-to-server messages of one socket: acks, cancels, requests, and the close.

    Args:
        websocket: an accepted socket.
        idle_s: how long a socket with no request live may stay silent before it is closed.
    """

    def __init__(self, websocket: WebSocket, idle_s: float) -> None:
        self.websocket = websocket
        self.idle_s = idle_s
        self.busy = False  # a request is being served: silence is the client rendering
        # When the socket last had something live: a frame from the client, or a request
        # ending. The idle deadline runs from here, so a client slow to ack a reply's last
        # chunk is not closed the moment that reply ends.
        self.active_at = asyncio.get_running_loop().time()
        self.acked = 0  # highest sequence number the client has acknowledged
        self.current: Any = None  # id of the request being streamed
        self.departure = Departure()  # the socket closed, or the client cancelled
        self.closed = False
        self.requests: asyncio.Queue[Json] = asyncio.Queue(MAX_PENDING)
        self.stalled = False  # the runtime cut the current request: the client owes too much
        self._progress = asyncio.Event()

    async def run(self) -> None:
        """Read client messages until the socket closes.

        Each message is decoded as strictly as an HTTP body; one that is not a JSON object is
        a protocol violation: the client gets an `error` saying why, and the socket closes.
        """
        try:
            loop = asyncio.get_running_loop()
            while True:
                left = self.active_at + self.idle_s - loop.time()
                try:
                    frame = await asyncio.wait_for(self.websocket.receive(), max(left, 0.0))
                except TimeoutError:
                    if self.busy or not self.requests.empty():
                        self.active_at = loop.time()
                        continue
                    if loop.time() < self.active_at + self.idle_s:
                        continue  # a request ended meanwhile: idle from then
                    await self.websocket.close(code=1000, reason="idle")
                    break
                self.active_at = loop.time()
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
                await self._on(message)
        except (WebSocketDisconnect, RuntimeError, ClientGone):
            pass
        self.closed = True
        self.departure.leave()
        self._progress.set()

    async def _on(self, message: Json) -> None:
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
            try:
                self.requests.put_nowait(message)
            except asyncio.QueueFull:  # a bounded socket: the client sends ahead, not floods
                await _send(self.websocket, _error_message(_echo_id(message), _busy()))

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
    idle_s: float,
) -> None:
    """Serve one socket: requests one at a time, each streamed under the ack window.

    The key is checked on the upgrade, before it is accepted: a refused socket gets an HTTP
    401 with an OpenAI-style body and never opens.

    Args:
        websocket: the socket (not yet accepted).
        service: the completion service.
        keyring: resolves API keys (the upgrade's `Authorization`, or its key subprotocol).
        window: the most unacknowledged chunks (`backpressure.client_window`).
        idle_s: how long a socket with no request live may stay silent
            (`server.ws_idle_timeout_ms`).
    """
    offered = list(websocket.scope.get("subprotocols") or ())
    try:
        identity = keyring.authenticate(_upgrade_authorization(websocket, offered))
    except GatewayError as exc:
        await _deny(websocket, exc)
        return
    await websocket.accept(subprotocol=PROTOCOL if PROTOCOL in offered else None)
    channel = AckChannel(websocket, idle_s)
    reader = asyncio.create_task(channel.run())
    try:
        while not channel.closed:
            getter = asyncio.create_task(channel.requests.get())
            await asyncio.wait([getter, reader], return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                break
            channel.busy = True
            try:
                await _one_request(websocket, channel, service, identity, window, getter.result())
            finally:
                channel.busy = False
                channel.active_at = asyncio.get_running_loop().time()
    finally:
        reader.cancel()
        await asyncio.wait([reader])


async def _one_request(
    websocket: WebSocket,
    channel: AckChannel,
    service: CompletionService,
    identity: Identity,
    window: int,
    message: Json,
) -> None:
    request_id = _echo_id(message)
    channel.acked, sent, channel.current, channel.stalled = 0, 0, request_id, False
    if not channel.closed:
        channel.departure = Departure()
    session: StreamSession | None = None
    try:
        _check_request(message)
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


def _upgrade_authorization(websocket: WebSocket, offered: list[str]) -> str | None:
    """The upgrade's `Authorization`, or the key a browser put in a subprotocol, as a header."""
    header = websocket.headers.get("authorization")
    if header is not None:
        return header
    tokens = [p for p in offered if p.startswith(_KEY_PREFIX)]
    if not tokens:
        return None
    encoded = tokens[0][len(_KEY_PREFIX) :]
    try:
        key = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).decode()
    except (binascii.Error, ValueError):
        raise GatewayError(
            401,
            f"the {_KEY_PREFIX}* subprotocol must carry base64url(KEY) without padding",
            "invalid_api_key",
        ) from None
    return f"Bearer {key}"


async def _deny(websocket: WebSocket, exc: GatewayError) -> None:
    """Refuse the upgrade with an HTTP response (or a bare 403 on a server without that)."""
    if "websocket.http.response" in (websocket.scope.get("extensions") or {}):
        await websocket.send_denial_response(exc.response())
    else:
        await websocket.close(code=1008)


def _echo_id(message: Json) -> Any:
    """The request's id, when it is one the protocol echoes (see `_check_request`)."""
    rid = message.get("id")
    if rid is None or (isinstance(rid, int) and not isinstance(rid, bool)):
        return rid
    if isinstance(rid, str) and len(rid) <= MAX_ID_CHARS:
        return rid
    return None


def _check_request(message: Json) -> None:
    rid = message.get("id")
    if rid is not None and _echo_id(message) is None:
        raise GatewayError(
            400,
            f"a request 'id' is a string of at most {MAX_ID_CHARS} characters or an integer",
            "invalid_request",
            param="id",
        )
    if "api_key" in message:
        raise GatewayError(
            400,
            "'api_key' in a request message is not read: authenticate the upgrade instead "
            f"('Authorization: Bearer KEY', or the subprotocols {PROTOCOL!r} and "
            f"'{_KEY_PREFIX}' + base64url(KEY))",
            "invalid_request",
            param="api_key",
        )


def _busy() -> GatewayError:
    return GatewayError(
        429,
        f"this socket already has {MAX_PENDING} requests waiting behind the one being "
        "streamed: wait for an 'end' before sending more, or open another socket",
        "too_many_pending_requests",
        headers={"Retry-After": str(TRANSPORT_RETRY_AFTER_S)},  # every 429 says when
    )


def _end(request_id: Any, reason: str, sent: int) -> Json:
    return {"type": "end", "id": request_id, "reason": reason, "sent": sent}


def _error_message(request_id: Any, exc: GatewayError) -> Json:
    """An `error` frame: the status, the reason (as an HTTP refusal's `x-llmflow-reason`), the
    body, and `retry_after` (seconds) where the HTTP answer has `Retry-After`."""
    value = exc.headers.get("Retry-After")
    retry = {"retry_after": int(value)} if value else {}
    head = {"type": "error", "id": request_id, "status": exc.status, "reason": exc.code}
    return {**head, **exc.body, **retry}


async def _send(websocket: WebSocket, message: Json) -> None:
    try:
        await websocket.send_text(json.dumps(message, separators=(",", ":")))
    except (WebSocketDisconnect, RuntimeError, OSError):
        raise ClientGone from None
