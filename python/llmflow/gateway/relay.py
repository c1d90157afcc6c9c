"""The Rust relay's host: the `llmflow._core.Relay` whose tokio threads the front door runs on.

The native front (`front.py`, `rust/src/front/`) serves the governed streams on the relay's
runtime: each stream's events go to its own task there, not to Python. This host builds the
relay with the config's window, pause, flush interval and thread count, gives `/metrics` its
inter-chunk histogram (`metrics.relay`), and stops it with the gateway.

The relay reports through a wake-up pipe only for streams opened without a task of their own;
the front's all have one and Python opens none, so the pipe is only drained here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from typing import TYPE_CHECKING

from llmflow._core import Relay

if TYPE_CHECKING:
    from llmflow.config import Settings

__all__ = ["RelayHost"]

log = logging.getLogger("llmflow.gateway")
_TOKEN_FLUSH_MS = 20.0  # token counts reach the runtime at most this late (KV ledger, VTC)


class RelayHost:
    """The relay and its wake-up pipe.

    Args:
        settings: the gateway's config (window, pause, flush interval, workers).
    """

    def __init__(self, settings: Settings) -> None:
        read_end, write_end = os.pipe()
        os.set_blocking(read_end, False)
        os.set_blocking(write_end, False)
        self._wake_fd = read_end
        self.relay = Relay(
            write_end,
            threads=settings.server.threads,
            client_window=settings.backpressure.client_window,
            pause_when_full=settings.backpressure.pause_when_full,
            flush_interval_ms=settings.streaming.sse_flush_interval,
            token_flush_ms=_TOKEN_FLUSH_MS,
            max_event_bytes=settings.server.max_event_bytes,
        )
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        """Listen for the relay's wake-ups on the running loop."""
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._wake_fd, self._wake)

    def close(self) -> None:
        """Stop listening (the relay's threads stop when it is dropped)."""
        if self._loop is not None:
            self._loop.remove_reader(self._wake_fd)
            self._loop = None
        self.relay.shutdown()
        os.close(self._wake_fd)

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError):  # woken by an earlier batch's byte
            os.read(self._wake_fd, 4096)
        for event in self.relay.events():  # none: no stream is opened from Python
            log.warning("relay event for a stream Python did not open: %r", event)
