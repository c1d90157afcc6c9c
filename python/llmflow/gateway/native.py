"""What Python does for the requests the native front serves: carry its share, count them.

With `server.front: native`, the governed completions the front is sure of are served in Rust
(`rust/src/front/governed.rs`), against the same runtime the Python host feeds. Two things
still reach this loop, through one wake-up pipe:

- actions for Python's own requests (a WebSocket session, a request the front passed on)
  that an event of a native request caused: the slot it freed starts one of ours. The host
  carries them out as if its own call had returned them (`Host.carry`);
- one record per native request at its first token and at its end, which the metrics and the
  access log count as they count a session (one registry, one file, one `/metrics`).

Nothing is decided here.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from llmflow.gateway.errors import GatewayError

if TYPE_CHECKING:
    from llmflow.gateway.host import Host
    from llmflow.gateway.metrics import GatewayMetrics

__all__ = ["NativeInbox", "Served"]


@dataclass(slots=True)
class _Prepared:
    """What the metrics and the access log read of a request's `Prepared`."""

    tier: str
    tenant: str
    arrived: float
    prompt_tokens: int
    max_tokens: int | None


@dataclass(slots=True)
class _Parser:
    completion_tokens: int = 0


class _NotAdmitting:
    """`session.admitted` for a request whose admission raised nothing Python must read."""

    @staticmethod
    def done() -> bool:
        return False


@dataclass(slots=True)
class Served:
    """A native request's record, shaped as the metrics and the access log read a session."""

    request_id: int
    prepared: _Prepared
    end: str
    backend: str | None
    queue_wait_s: float
    first_token_at: float | None
    error: GatewayError | None
    parser: _Parser = field(default_factory=_Parser)
    admitted: _NotAdmitting = field(default_factory=_NotAdmitting)
    shadow: None = None


def served(record: dict[str, Any]) -> Served:
    """A native request's record (`Front.take`) as a `Served`."""
    arrived = record["arrived_us"] / 1e6
    started = record["started_us"]
    first = record["first_token_us"]
    error = None
    if record["error"] is not None:
        status, code = record["error"]
        headers = {"X-Request-Id": f"llmflow-{record['id']}"}
        error = GatewayError(status, code, code, headers=headers)
    return Served(
        record["id"],
        _Prepared(
            record["tier"], record["tenant"], arrived, record["prompt_tokens"],
            record["max_tokens"],
        ),
        record["end"],
        record["backend"],
        (started / 1e6 - arrived) if started is not None else 0.0,
        first / 1e6 if first is not None else None,
        error,
        _Parser(record["completion_tokens"]),
    )


class NativeInbox:
    """Reads the native front's inbox on the event loop: Python's actions, the records.

    Args:
        native: the native routes (`llmflow._core.NativeRoutes`), whose `take()` empties it.
        wake_fd: the read end of its wake-up pipe.
        host: the runtime host that carries out Python's actions.
        metrics: where the records are counted.
    """

    def __init__(self, native: Any, wake_fd: int, host: Host, metrics: GatewayMetrics) -> None:
        self.native, self._wake_fd = native, wake_fd
        self.host, self.metrics = host, metrics
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        """Listen for wake-ups on the running loop."""
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._wake_fd, self.drain)

    def close(self) -> None:
        """Stop listening, after taking what is left."""
        if self._loop is not None:
            self._loop.remove_reader(self._wake_fd)
            self._loop = None
            self.drain()
        os.close(self._wake_fd)

    def drain(self) -> None:
        """Carry out and count everything the front queued since the last wake-up."""
        with contextlib.suppress(BlockingIOError):  # woken by an earlier batch's byte
            os.read(self._wake_fd, 4096)
        actions, records = self.native.take()
        if actions:
            self.host.carry(actions)
        for record in records:
            self._count(record)

    def _count(self, record: dict[str, Any]) -> None:
        session = served(record)
        metrics = self.metrics
        if record["first_token_only"]:
            metrics.first_token(session)  # type: ignore[arg-type]
            return
        if record["refused"] and session.error is not None:
            metrics.rejected(session.prepared, session.error)  # type: ignore[arg-type]
            return
        if record["truncated"]:
            metrics.truncated(session.end)
        if record["upstream_aborted"]:
            metrics.upstream_aborted(session.end)
        metrics.request_ended(session)  # type: ignore[arg-type]
