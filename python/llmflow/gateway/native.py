"""What Python does for the requests the native front serves: carry its share, make its spans.

The governed completions the front is sure of are served in Rust
(`rust/src/front/governed.rs`), against the same runtime the Python host feeds. The front
counts them itself, in the tally the Python path's sessions count in (`metrics.tally`, one
`/metrics`), and writes their access-log rows (one file, one writer). Two things still reach
this loop, through one wake-up pipe:

- actions for Python's own requests (a WebSocket session, a request the front passed on)
  that an event of a native request caused: the slot it freed starts one of ours. The host
  carries them out as if its own call had returned them (`Host.carry`);
- the end record of a native request Python has work with (its end wakes the loop, one byte
  for however many ended before the loop reads them): with telemetry on, its spans are made
  from it (the front decided its trace ids and sent vLLM its `traceparent`; `telemetry.py`),
  and the warning of a split request's prefill hop answered without KV transfer parameters is
  logged (`disagg.py`). The front keeps no other record.

Nothing is decided or counted here.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from llmflow._core import FrontChecks, FrontKeys, NativeRoutes
from llmflow.gateway.disagg import warn_unread
from llmflow.gateway.errors import GatewayError
from llmflow.gateway.session import fingerprint_key
from llmflow.gateway.shadow import verdict
from llmflow.gateway.telemetry import NativeTrace

if TYPE_CHECKING:
    from llmflow._core import Front
    from llmflow.gateway.app import Gateway
    from llmflow.gateway.host import Host
    from llmflow.gateway.metrics import GatewayMetrics
    from llmflow.gateway.shadow import Verdict

__all__ = ["NativeInbox", "Served", "native_routes"]


def native_routes(front: Front, gateway: Gateway, own_hosts: frozenset[str] | None) -> NativeInbox:
    """Serve `gateway`'s governed completions natively on `front`, in every mode (shadow mode's
    policy runtime hears the front's requests in the core; a split pool's two hops are the
    front's, and so are the spans' ids with telemetry on). Call once the app has started."""
    s, service, ctx = gateway.settings, gateway.service, gateway.ctx
    assert service is not None
    assert ctx is not None
    limits = service.limits
    checks = FrontChecks(
        service.models, service.bytes_per_token, service.streaming, limits.max_messages,
        limits.max_n, limits.max_tokens, fingerprint_key(),
        aliases=service.aliases, prefix_models=set(service.prefix_models),
        block_size=service.block_size,
    )
    keys = FrontKeys(
        s.auth_enabled, (s.anonymous_tenant, s.default_tier), s.limits.max_api_key_bytes,
        [(k.encode("utf-8", "surrogatepass"), t.name, t.tier)
         for t in s.tenants for k in t.api_keys],
    )
    backends = [
        (b.name, ctx.routes[b.name].url, ctx.routes[b.name].priority_scheduling, b.tls_ca_file,
         b.tls_client_cert, b.tls_client_key)
        for b in s.backends
    ]
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)
    os.set_blocking(write_end, False)
    native = NativeRoutes(
        gateway.runtime, gateway.relay.relay, write_end, checks, keys, backends,
        tally=gateway.metrics.tally,
        own_hosts=sorted(own_hosts) if own_hosts is not None else None,
        write_timeout_ms=s.server.write_timeout_ms,
        sample_ratio=gateway.tracing.sample_ratio if gateway.tracing is not None else None,
    )
    gateway.metrics.native = native  # its requests count in the per-tier gauges
    inbox = NativeInbox(native, read_end, gateway.host, gateway.metrics)
    inbox.start()
    native.serve_on(front)
    return inbox


@dataclass(slots=True)
class _Options:
    stream: bool


@dataclass(slots=True)
class _Prepared:
    """What the spans read of a request's `Prepared`."""

    tier: str
    tenant: str
    arrived: float
    prompt_tokens: int
    max_tokens: int | None
    path: str
    options: _Options
    model: str | None


@dataclass(slots=True)
class _Parser:
    completion_tokens: int = 0


@dataclass(slots=True)
class _Start:
    max_tokens: int | None  # a brownout's bound


class _NotAdmitting:
    """`session.admitted` for a request whose admission raised nothing Python must read."""

    @staticmethod
    def done() -> bool:
        return False


@dataclass(slots=True)
class Served:
    """A native request's record, shaped as the spans read a session."""

    request_id: int
    prepared: _Prepared
    end: str
    backend: str | None
    queue_wait_s: float
    first_token_at: float | None
    error: GatewayError | None
    ended_at: float | None = None
    parser: _Parser = field(default_factory=_Parser)
    admitted: _NotAdmitting = field(default_factory=_NotAdmitting)
    shadow: Verdict | None = None  # shadow mode: what the policy runtime did with it
    started_at: float | None = None  # sent upstream (monotonic)
    start_action: _Start | None = None
    trace: NativeTrace | None = None  # telemetry's ids, when on


def served(record: dict[str, Any]) -> Served:
    """A native request's record (`Front.take`) as a `Served`."""
    arrived = record["arrived_us"] / 1e6
    started = record["started_us"]
    first = record["first_token_us"]
    error = None
    if record["error"] is not None:
        status, code = record["error"]
        headers = {"X-Request-Id": f"llmflow-{record['id']}"}
        if record["retry_after_s"] is not None:
            headers["Retry-After"] = str(record["retry_after_s"])
        error = GatewayError(status, code, code, headers=headers)
    waited = record["queue_wait_us"]  # the runtime's, as its `Start` said
    trace = record["trace"]
    return Served(
        record["id"],
        _Prepared(
            record["tier"], record["tenant"], arrived, record["prompt_tokens"],
            record["max_tokens"], record["path"], _Options(record["stream"]), record["model"],
        ),
        record["end"],
        record["backend"],
        waited / 1e6 if waited is not None else 0.0,
        first / 1e6 if first is not None else None,
        error,
        record["ended_us"] / 1e6 if record["ended_us"] else None,
        _Parser(record["completion_tokens"]),
        started_at=started / 1e6 if started is not None else None,
        start_action=_Start(record["brownout_max_tokens"]) if started is not None else None,
        trace=NativeTrace(**trace) if trace is not None else None,
        shadow=verdict(record["shadow"]),
    )


class NativeInbox:
    """Reads the native front's inbox on the event loop: Python's actions, the records it has
    work with.

    Args:
        native: the native routes (`llmflow._core.NativeRoutes`), whose `take()` empties it.
        wake_fd: the read end of its wake-up pipe.
        host: the runtime host that carries out Python's actions.
        metrics: the gateway's metrics (its `tracing` makes the spans).
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
        """Carry out everything the front queued since the last wake-up."""
        with contextlib.suppress(BlockingIOError):  # woken by an earlier batch's byte
            os.read(self._wake_fd, 4096)
        actions, records = self.native.take()
        if actions:
            self.host.carry(actions)
        for record in records:
            self._ended(record)

    def _ended(self, record: dict[str, Any]) -> None:
        """A native request's end, counted by the front already: its warning, its spans."""
        if record["prefill_unread"] is not None:  # logged at its end, not when it answered
            warn_unread(record["prefill_unread"], f"llmflow-{record['id']}")
        tracing = self.metrics.tracing
        if tracing is not None and record["trace"] is not None:
            session = served(record)
            assert session.trace is not None
            tracing.served(session, session.trace, session.error is not None and record["refused"])
