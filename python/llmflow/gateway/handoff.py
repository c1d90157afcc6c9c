"""Socket hand-off: uvicorn lends a streaming reply's connection to the Rust relay.

FastAPI stays the front: routes, validation, auth, errors, WebSocket and the dashboard run
under uvicorn as before. Only a streaming reply, once its first token is ready, leaves
Python: the route takes the client's socket from uvicorn (`llmflow.handoff` in the ASGI
scope's extensions), and the relay writes the head and every chunk itself, with no Python on
the per-chunk path. When the reply ends cleanly on a keep-alive connection, the relay hands
the socket back and `adopt` starts a fresh uvicorn protocol on it, so the client's next
request is served as if nothing had happened.

The extension exists only under `HandoffProtocol` (uvicorn with httptools, HTTP/1.1); under
any other server the gateway streams through Python as before.

The protocol also guards the listener, below any request (so below the runtime): a client
must send its whole request within `read_timeout_s` (uvicorn has no such timer, so a
slowloris client held its connection for ever), and a connection accepted when file
descriptors are nearly gone is answered with a 503 and closed, keeping a reserve for the
backends' connections instead of leaving clients in the accept backlog.
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

if TYPE_CHECKING:
    import asyncio

    from llmflow.gateway.types import Scope

__all__ = ["EXTENSION", "HandoffProtocol", "TakenSocket", "handoff_of"]

EXTENSION = "llmflow.handoff"
_SEND_BUFFER_BYTES = 64 * 1024  # per relayed reply; SSE chunks are a few hundred bytes
_FD_RESERVE = 64  # descriptors kept for upstream connections, scrapes and the relay
_REFUSAL_RETRY_S = 1  # a transport-level refusal: no request exists for the runtime to price
_OUT_OF_FDS = (
    b'{"error":{"message":"the gateway has no file descriptors left for new connections; '
    b'retry shortly","type":"server_error","param":null,"code":"too_many_connections"}}'
)
_TIMED_OUT = (
    b'{"error":{"message":"the request was not received in time: send the headers and the '
    b'body without pausing","type":"invalid_request_error","param":null,'
    b'"code":"request_timeout"}}'
)
log = logging.getLogger("llmflow.gateway")


@dataclass(slots=True)
class TakenSocket:
    """A client connection taken from uvicorn: the relay owns `fd` now."""

    fd: int
    keep_alive: bool
    protocol: HandoffProtocol

    def adopt(self, fd: int) -> None:
        """Serve the connection's next requests with a fresh uvicorn protocol."""
        self.protocol.adopt(fd)


def _error_response(status: bytes, body: bytes, retry_after: int | None = None) -> bytes:
    head = b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\n"
    if retry_after is not None:
        head += b"retry-after: " + str(retry_after).encode() + b"\r\n"
    head += b"connection: close\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n"
    return head + body


class HandoffProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol that can give its connection away (and take one back).

    `read_timeout_s`: how long a client may take to send a request's head and body
    (`server.read_timeout_ms`; set it with `configured`).
    """

    read_timeout_s: float = 30.0
    _read_timer: asyncio.TimerHandle | None = None
    _refuse = False
    _begun = False

    @classmethod
    def configured(cls, read_timeout_s: float) -> type[HandoffProtocol]:
        """This protocol with another read timeout."""
        return type(cls.__name__, (cls,), {"read_timeout_s": read_timeout_s})

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        # Descriptors are handed out lowest first: a number this high means few are left.
        self._refuse = sock is not None and sock.fileno() >= limit - _FD_RESERVE
        self._arm_read_timer()

    def data_received(self, data: bytes) -> None:
        if self._refuse:  # answered at once, before parsing: it costs no request
            if not self.transport.is_closing():
                log.warning("out of file descriptors: refusing a connection")
                body = _error_response(b"503 Service Unavailable", _OUT_OF_FDS, _REFUSAL_RETRY_S)
                self.transport.write(body)
                self.transport.close()
            return
        super().data_received(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_read_timer()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._begun = True
        self._arm_read_timer()
        if self.scope.get("http_version", "1.1") == "1.1":
            extensions: dict[str, Any] = {EXTENSION: self._take}
            self.scope["extensions"] = extensions

    def handle_websocket_upgrade(self) -> None:
        self._disarm_read_timer()  # the connection is the WebSocket protocol's from now on
        super().handle_websocket_upgrade()

    def on_message_complete(self) -> None:
        self._disarm_read_timer()
        self._begun = False
        super().on_message_complete()

    def _arm_read_timer(self) -> None:
        if self._read_timer is None:
            self._read_timer = self.loop.call_later(self.read_timeout_s, self._read_timed_out)

    def _disarm_read_timer(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _read_timed_out(self) -> None:
        """The request did not arrive in time (slowloris): 408 if it began, then close."""
        self._read_timer = None
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if self._begun and (cycle is None or not cycle.response_started):
            self.transport.write(_error_response(b"408 Request Timeout", _TIMED_OUT))
            if cycle is not None:
                cycle.disconnected = True  # the handler waiting for the body hears it left
        self.transport.close()

    def _take(self) -> TakenSocket | None:
        """Detach the socket: a duplicate of its fd goes to the caller, uvicorn forgets it.

        Returns None when the connection is closing or another request is pipelined behind
        this one (its bytes belong to uvicorn's parser).
        """
        transport, cycle = self.transport, self.cycle
        sock = transport.get_extra_info("socket")
        if cycle is None:
            return None
        if sock is None or transport.is_closing():
            cycle.disconnected = True  # the client is going: nothing to answer, nobody to tell
            return None
        if self.pipeline:
            return None
        # A stalled client holds at most this much in the kernel, not the megabytes TCP
        # autotuning would grant: the relay's window then fills when the client stops reading.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SEND_BUFFER_BYTES)
        fd = os.dup(sock.fileno())
        keep_alive = bool(cycle.keep_alive)
        cycle.disconnected = True  # uvicorn sends nothing more on this cycle (no 500 either)
        transport.pause_reading()
        transport.abort()  # closes uvicorn's fd only: the duplicate keeps the connection open
        return TakenSocket(fd, keep_alive, self)

    def adopt(self, fd: int) -> None:
        """Start a new protocol of this kind on a connection the relay handed back."""
        loop = self.loop
        sock = socket.socket(fileno=fd)

        def factory() -> HandoffProtocol:
            return HandoffProtocol(self.config, self.server_state, self.app_state, _loop=loop)

        task = loop.create_task(_adopt(loop, factory, sock))
        self.server_state.tasks.add(task)
        task.add_done_callback(self.server_state.tasks.discard)


async def _adopt(loop: asyncio.AbstractEventLoop, factory: Any, sock: socket.socket) -> None:
    try:
        await loop.connect_accepted_socket(factory, sock)
    except OSError as exc:  # the client left in between
        log.debug("handed-back connection closed: %r", exc)
        with contextlib.suppress(OSError):
            sock.close()


def handoff_of(scope: Scope) -> Any:
    """The scope's hand-off callable, or None when the server cannot lend its socket."""
    extensions = scope.get("extensions") or {}
    return extensions.get(EXTENSION)
