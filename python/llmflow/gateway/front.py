"""The native front door: the extension's `Front` owns the public port.

The front (`rust/src/front/`, on the relay's tokio threads) accepts every client connection,
reads each request with the gateway's limits and passes it to the app, which uvicorn serves on
a private unix socket in a directory of this process's own (mode 0700: only this user, hence
only the front, can connect). The client's address travels as `x-llmflow-peer`, which
`PeerFromFront` turns back into the scope's `client`. The governed streams the front is sure
of it serves itself (`native.py`); what it passes on, the app serves as a whole, through Python.

The public socket is bound here, before the app starts, so `llmflow serve` keeps its host and
port handling (and a bind error shows at once); its fd goes to the `Front` once the app has
started (its lifespan built the relay, and uvicorn listens on the unix socket).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import tempfile
import time
from typing import TYPE_CHECKING

from llmflow._core import Front
from llmflow.gateway.middleware import allowed_host_names
from llmflow.gateway.native import native_routes

if TYPE_CHECKING:
    from llmflow.config import Settings
    from llmflow.gateway.app import Gateway

__all__ = ["FrontDoor"]

_BACKLOG = 2048  # uvicorn's default backlog, for the listener the front takes over
# A shutdown's wait for the app's replies still on their way through the front (a WebSocket,
# which counts for its whole life, is dropped after it).
_REPLY_GRACE_S = 2.0


class FrontDoor:
    """The public listener, bound now and served by the native front once the app runs.

    Args:
        settings: the validated config (limits and timeouts the front reads requests within).
        host: address to listen on (default `server.host`).
        port: port to listen on (default `server.port`; 0 picks a free one).
    """

    def __init__(self, settings: Settings, host: str | None = None, port: int | None = None):
        self.settings = settings
        host = settings.server.host if host is None else host
        port = settings.server.port if port is None else port
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.listener = socket.create_server((host, port), family=family, backlog=_BACKLOG)
        self.port: int = self.listener.getsockname()[1]
        self._dir = tempfile.mkdtemp(prefix="llmflow-front-")  # 0700: private to this user
        self.app_path = os.path.join(self._dir, "app.sock")
        self.app_socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.app_socket.bind(self.app_path)
        self._front: Front | None = None

    def start(self, gateway: Gateway) -> None:
        """Hand the listener to the front; call once the app has started (uvicorn listens)."""
        s = self.settings
        self._front = Front(
            gateway.relay.relay,
            self.listener.detach(),
            self.app_path,
            max_header_bytes=s.limits.max_header_bytes,
            max_body_bytes=s.server.max_body_bytes,
            read_timeout_ms=s.server.read_timeout_ms,
            write_timeout_ms=s.server.write_timeout_ms,
        )
        hosts = [s.server.host, *s.server.allowed_hosts]
        own = None if s.auth_enabled else allowed_host_names(hosts)
        gateway.native = native_routes(self._front, gateway, own)

    async def finish_replies(self, timeout_s: float = _REPLY_GRACE_S) -> None:
        """Wait (at most `timeout_s`) until every reply the app has answered through the front
        is written to its client: a drained session has put its last bytes (a cut's notice,
        `[DONE]`) in the app's reply, and `close` would drop them on their way."""
        if self._front is None:
            return
        bound = time.monotonic() + timeout_s
        while self._front.passing and time.monotonic() < bound:
            await asyncio.sleep(0.01)

    def close(self) -> None:
        """Stop accepting and drop the front's connections; remove the private socket's file
        (the socket itself is uvicorn's, which closes it as it stops)."""
        if self._front is not None:
            self._front.close()
        self.listener.close()
        shutil.rmtree(self._dir, ignore_errors=True)
