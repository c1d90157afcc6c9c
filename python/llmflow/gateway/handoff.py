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
"""

from __future__ import annotations

import contextlib
import logging
import os
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


class HandoffProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol that can give its connection away (and take one back)."""

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self.scope.get("http_version", "1.1") == "1.1":
            extensions: dict[str, Any] = {EXTENSION: self._take}
            self.scope["extensions"] = extensions

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
