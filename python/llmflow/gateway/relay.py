"""The Rust relay's host: the `llmflow._core.Relay` whose tokio threads the front door runs on.

The native front (`front.py`, `rust/src/front/`) serves the governed streams on the relay's
runtime: each stream's events go to its own task there, not to Python. This host builds the
relay with the config's window, pause, flush interval and thread count, gives `/metrics` its
inter-chunk histogram (`metrics.relay`), and stops it with the gateway.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmflow._core import Relay

if TYPE_CHECKING:
    from llmflow.config import Settings

__all__ = ["RelayHost"]

_TOKEN_FLUSH_MS = 20.0  # token counts reach the runtime at most this late (KV ledger, VTC)


class RelayHost:
    """The relay.

    Args:
        settings: the gateway's config (window, pause, flush interval, workers).
    """

    def __init__(self, settings: Settings) -> None:
        self.relay = Relay(
            threads=settings.server.threads,
            client_window=settings.backpressure.client_window,
            pause_when_full=settings.backpressure.pause_when_full,
            flush_interval_ms=settings.streaming.sse_flush_interval,
            token_flush_ms=_TOKEN_FLUSH_MS,
            max_event_bytes=settings.server.max_event_bytes,
        )

    def close(self) -> None:
        """Stop the relay's threads and every stream."""
        self.relay.shutdown()
