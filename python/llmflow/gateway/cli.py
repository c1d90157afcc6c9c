"""`llmflow serve`: run the gateway under uvicorn, with a graceful drain on SIGINT/SIGTERM.

With `admin.port` set, a second listener serves `/api/state`, `/dashboard` and `/metrics` (behind
`admin.api_key`) in the same process and event loop; it starts once the gateway has, and stops
after the gateway's drain. The extension's front door owns the public port; uvicorn serves
the app behind it on a private unix socket (`front.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import uvicorn

from llmflow.config import ConfigFileError, load_settings
from llmflow.gateway.app import create_admin_app, create_app
from llmflow.gateway.front import FrontDoor
from llmflow.gateway.listener import server_options
from llmflow.gateway.ws import FrameRedactor

if TYPE_CHECKING:
    import argparse
    import socket
    from collections.abc import Generator
    from typing import TextIO

    from fastapi import FastAPI

    from llmflow.config import Settings
    from llmflow.gateway.app import Gateway

__all__ = ["GatewayServer", "add_commands", "serve"]

_FORCE_AFTER_DRAIN_S = 5  # uvicorn's own backstop, past the gateway's drain timeout
_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # what ends `llmflow serve` gracefully


class GatewayServer(uvicorn.Server):
    """uvicorn, but shutdown drains the gateway before it stops taking connections.

    SIGINT/SIGTERM start the drain; once it is done the process exits with status 0 (uvicorn
    itself re-raises the signal after shutting down, which would end the process by it).
    Companion servers (the admin listener) are told to exit once the drain is done.
    """

    companions: tuple[uvicorn.Server, ...] = ()
    front: FrontDoor | None = None  # the native front door, started once the app has

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        """Serve; companions start once the gateway has (they read its state) and stop after,
        and so does the front door (it connects to the app's socket, and runs on the relay)."""
        if not self.companions and self.front is None:
            await super().serve(sockets)
            return
        main = asyncio.create_task(super().serve(sockets))
        while not self.started and not main.done():
            await asyncio.sleep(0.01)
        gateway = _find_gateway(self.config.loaded_app)
        if self.front is not None and gateway is not None and not main.done():
            self.front.start(gateway)
        others = [asyncio.create_task(c.serve()) for c in self.companions if not main.done()]
        await asyncio.wait([main, *others], return_when=asyncio.FIRST_COMPLETED)
        self.should_exit = True  # one ended (a companion could not bind): end them all
        for companion in self.companions:
            companion.should_exit = True
        await asyncio.gather(main, *others)

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        """Route SIGINT/SIGTERM to a graceful exit while serving, then restore the handlers."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in _SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    async def shutdown(self, sockets: list[object] | None = None) -> None:  # type: ignore[override]
        """Drain live requests (stop admitting, wait, cut), then shut down as uvicorn does."""
        app = self.config.loaded_app
        gateway: Gateway | None = getattr(getattr(app, "state", None), "gateway", None)
        if gateway is None:  # uvicorn wraps the app; find the FastAPI one underneath
            gateway = _find_gateway(app)
        if gateway is not None:
            await gateway.drain()
        if self.front is not None:  # drained: the port closes with the app's listener
            await self.front.finish_replies()  # the drained sessions' last bytes
            self.front.close()
        for companion in self.companions:
            companion.should_exit = True
        await super().shutdown(sockets)  # type: ignore[arg-type]


class CompanionServer(uvicorn.Server):
    """A second listener in the gateway's loop: the main server owns the signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        """Leave signal handling to the main server."""
        yield


def _find_gateway(app: object) -> Gateway | None:
    for _ in range(8):
        state = getattr(app, "state", None)
        if state is not None and hasattr(state, "gateway"):
            return state.gateway  # type: ignore[no-any-return]
        app = getattr(app, "app", None)
        if app is None:
            return None
    return None


def add_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `serve` on the `llmflow` parser.

    Args:
        subparsers: the `llmflow` command group.
    """
    p = subparsers.add_parser(
        "serve",
        help="run the OpenAI-compatible gateway in front of vLLM",
        description="Run the gateway. Backends come from the config; with no backend URL the "
        "built-in simulated vLLM starts in-process, so `llmflow serve` alone works.",
    )
    p.add_argument("--config", type=Path, help="YAML config file (default: built-in defaults)")
    p.add_argument("--host", help="address to listen on (default: server.host, 127.0.0.1)")
    p.add_argument("--port", type=int, help="port to listen on (default: server.port, 8080)")
    p.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    p.add_argument(
        "--workers",
        type=int,
        metavar="N",
        help="threads of the front door and the relay (default: server.workers, else one per "
        "CPU this process may run on); admission, the queue and the KV ledger stay one, "
        "shared by all of them",
    )
    p.add_argument(
        "--trace",
        type=Path,
        metavar="FILE",
        help="record the runtime's events and actions as JSONL (replay with `llmflow trace "
        "replay FILE`)",
    )
    p.set_defaults(func=serve)


def serve(args: argparse.Namespace) -> int:
    """Run the gateway until SIGINT/SIGTERM; returns the exit status."""
    try:
        settings = load_settings(args.config)
    except ConfigFileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    settings = _override(settings, args.host, args.port, args.workers)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per scrape is noise
    logging.getLogger("uvicorn.error").addFilter(FrameRedactor())  # no API key in a debug log
    trace = _private_file(args.trace) if args.trace else None
    app = create_app(settings, trace)
    front = FrontDoor(settings)  # the public port, bound now; uvicorn serves the app behind it
    config = uvicorn.Config(
        app,
        uds=front.app_path,
        log_level=args.log_level,
        lifespan="on",
        access_log=False,
        **server_options(settings, behind_front=True),  # header and WebSocket message limits
        timeout_graceful_shutdown=math.ceil(settings.server.drain_timeout_ms / 1e3)
        + _FORCE_AFTER_DRAIN_S,
    )
    server = GatewayServer(config)
    server.front = front
    admin = settings.admin
    log = logging.getLogger("llmflow.gateway")
    log.info(
        "llmflow gateway listening on http://%s:%d%s",
        settings.server.host,
        settings.server.port,
        " (dashboard at /dashboard)" if admin.port is None else "",
    )
    try:
        if admin.port is not None:
            log.info(
                "admin listener on http://%s:%d (/dashboard, /api/state, /metrics)",
                admin.host,
                admin.port,
            )
            server.companions = (_admin_server(app, settings, args.log_level),)
        server.run(sockets=[front.app_socket])
    finally:
        front.close()
        if trace is not None:
            trace.close()
    return 0


def _private_file(path: Path) -> TextIO:
    """Open `path` for writing, readable by this user alone (0600, whatever the umask): a
    trace holds every request's tenant, timing and hashes of its body and prompt."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # an existing file keeps its mode through O_CREAT
    return os.fdopen(fd, "w", encoding="utf-8")


def _admin_server(app: FastAPI, settings: Settings, log_level: str) -> CompanionServer:
    config = uvicorn.Config(
        create_admin_app(app),
        host=settings.admin.host,
        port=settings.admin.port or 0,
        log_level=log_level,
        lifespan="off",
        access_log=False,
        **server_options(settings),
    )
    return CompanionServer(config)


def _override(
    settings: Settings, host: str | None, port: int | None, workers: int | None = None
) -> Settings:
    pairs = (("host", host), ("port", port), ("workers", workers))
    update = {k: v for k, v in pairs if v is not None}
    if not update:
        return settings
    server = settings.server.model_copy(update=update)
    return settings.model_copy(update={"server": server})
