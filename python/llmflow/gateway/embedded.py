"""The built-in simulated vLLM: backends configured without a URL run in this process.

`llmflow serve` with no backend URL gives a working gateway on a fresh machine: each such
backend is the simulator's vLLM-compatible server (`llmflow.sim.server.create_app`), served by
uvicorn on an ephemeral loopback port inside the gateway's own event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import socket
from typing import TYPE_CHECKING, Any

import uvicorn

if TYPE_CHECKING:
    from collections.abc import Generator

    from llmflow.config import Backend

__all__ = ["EmbeddedBackend", "QuietServer"]

log = logging.getLogger("llmflow.gateway")
_START_TIMEOUT_S = 10.0  # the in-process simulator binds and starts in well under a second


class QuietServer(uvicorn.Server):
    """A uvicorn server that leaves signals alone (the process's main server owns them)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        """Install no signal handlers."""
        yield


class EmbeddedBackend:
    """One simulated vLLM server on `127.0.0.1:<ephemeral>`.

    Args:
        backend: the backend's config (models, context length, GPUs).
    """

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.url = ""
        self._server: QuietServer | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> str:
        """Start serving; returns the base URL.

        Raises:
            RuntimeError: the simulator package is missing or did not start.
        """
        try:
            from llmflow.sim.server import create_app  # type: ignore[import-not-found,unused-ignore]
        except ImportError as exc:
            raise RuntimeError(
                f"backend {self.backend.name!r} has no url and the built-in "
                f"simulator is not available ({exc})"
            ) from exc
        app = create_app(**_sim_arguments(create_app, self.backend))
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", lifespan="on", access_log=False)
        self._server = QuietServer(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        for _ in range(int(_START_TIMEOUT_S / 0.01)):
            if self._server.started or self._task.done():
                break
            await asyncio.sleep(0.01)
        if not self._server.started:
            raise RuntimeError(f"the built-in simulator for {self.backend.name!r} did not start")
        self.url = f"http://127.0.0.1:{port}"
        log.info("backend %s: built-in simulated vLLM at %s", self.backend.name, self.url)
        return self.url

    async def stop(self) -> None:
        """Stop serving and wait for the server task."""
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await asyncio.wait([self._task], timeout=_START_TIMEOUT_S)


def _sim_arguments(factory: Any, backend: Backend) -> dict[str, Any]:
    offered: dict[str, Any] = {
        "models": list(backend.models),
        "max_model_len": backend.max_model_len,
        "scheduling_policy": backend.scheduling_policy,
    }
    if backend.kv_blocks:
        offered["num_gpu_blocks"] = backend.kv_blocks
    if backend.role != "both":
        # A split pool's instances hand prompts' KV over (the simulated NIXL connector).
        from llmflow.sim.server_pd import KvTransfer  # type: ignore[import-not-found,unused-ignore]

        offered["kv_transfer"] = KvTransfer()
    accepted = inspect.signature(factory).parameters
    return {k: v for k, v in offered.items() if k in accepted}
