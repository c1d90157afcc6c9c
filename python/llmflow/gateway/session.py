"""One governed request, from admission to release: the upstream reader and its cut-offs.

A session waits for the core to admit its ticket, opens the upstream stream, and reads it in a
task of its own into a sink: the bounded `ChunkWindow` for streaming clients, an `Accumulator`
for the rest. The core's expiries (first-token timeout, total deadline) and gateway shutdown
cancel the read; the session then closes upstream (vLLM aborts and frees the KV at once) and
ends the reply with a visible notice. Whatever happens, the ticket is released in `finally`.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio

from llmflow.gateway.backpressure import ChunkWindow
from llmflow.gateway.errors import GatewayError, retry_after_header
from llmflow.gateway.policy import Displaced, Expiry
from llmflow.gateway.streaming import Accumulator, ChunkParser, parse_item, tail_chunk
from llmflow.gateway.upstream import UpstreamError

if TYPE_CHECKING:
    from collections.abc import Callable

    from llmflow.gateway.metrics import GatewayMetrics
    from llmflow.gateway.policy import Policy, Ticket
    from llmflow.gateway.streaming import ClientOptions, Item
    from llmflow.gateway.types import Json, Outcome
    from llmflow.gateway.upstream import Upstream, UpstreamStream

__all__ = ["BackendRoute", "Prepared", "SessionContext", "StreamSession"]

_QUEUE_EXPIRY_STATUS = 503  # the queue could not place the request in time: try again later


@dataclass(frozen=True, slots=True)
class BackendRoute:
    """Where and how to send a backend its requests."""

    url: str
    priority_scheduling: bool  # vLLM runs with --scheduling-policy priority


@dataclass(slots=True)
class Prepared:
    """A validated request, ready to submit: everything checked before any backend is touched."""

    options: ClientOptions
    tenant: str
    tier: str
    path: str
    body: Json
    prompt_tokens: int
    max_tokens: int
    arrived: float = field(default_factory=time.monotonic)


@dataclass(slots=True)
class SessionContext:
    """What every session shares: the core runtime, the client, routes, settings, registries."""

    policy: Policy
    upstream: Upstream
    routes: dict[str, BackendRoute]
    metrics: GatewayMetrics
    first_token_error: bool  # on first-token timeout answer 504 (else a degraded reply)
    client_window: int
    pause_when_full: bool
    on_backend_down: Callable[[str, str], None]  # (backend, error): mark it unhealthy
    sessions: set[StreamSession] = field(default_factory=set)
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)


class StreamSession:
    """The lifetime of one governed request.

    Args:
        ctx: shared runtime.
        prepared: the validated request.
        ticket: its ticket from `Policy.submit` (admitted or queued).
    """

    def __init__(self, ctx: SessionContext, prepared: Prepared, ticket: Ticket) -> None:
        self.ctx, self.prepared, self.ticket = ctx, prepared, ticket
        options = prepared.options
        self.parser = ChunkParser(options)
        self.window = ChunkWindow(ctx.client_window, ctx.pause_when_full)
        self.accumulator = Accumulator(options)
        self.ready = asyncio.Event()  # first token arrived, or the read ended
        self.done = asyncio.Event()  # the read ended and the ticket is released
        self.error: GatewayError | None = None  # failure before any token: answer with a status
        self.end = "running"  # completed, error, deadline, first_token_timeout, cancelled, ...
        self.first_token_at: float | None = None
        self._stream: UpstreamStream | None = None
        self._scope: anyio.CancelScope | None = None
        self._cut: str | None = None
        self._reader: asyncio.Task[None] | None = None
        self._upstream_complete = False
        ctx.sessions.add(self)

    @property
    def streaming(self) -> bool:
        """True when the client asked for SSE."""
        return self.prepared.options.stream

    async def start(self) -> None:
        """Wait for admission, start reading upstream, return at the first token or the end.

        Raises:
            GatewayError: the queue wait expired (503) or the gateway is shutting down.
        """
        try:
            await self.ticket.admitted
        except Displaced as exc:
            self._finish_without_reader("cancelled")
            raise GatewayError(
                429,
                "request displaced from the queue by a more important request or by a tenant "
                "holding less than its fair share of the waiting places; retry later",
                "displaced",
                headers=retry_after_header(exc.retry_after_s),
            ) from None
        except Expiry as exc:
            shutdown = exc.reason == "shutdown"
            self._finish_without_reader("cancelled" if shutdown else "timeout")
            message = "the gateway is shutting down" if shutdown else "queue wait expired"
            headers = None if shutdown else retry_after_header(exc.retry_after_s)
            raise GatewayError(
                _QUEUE_EXPIRY_STATUS, f"{message} ({exc.reason})", exc.reason, headers=headers
            ) from None
        self._reader = asyncio.create_task(self._read(), name=f"llmflow-read-{self.request_id}")
        self.ctx.tasks.add(self._reader)
        self._reader.add_done_callback(self.ctx.tasks.discard)
        await self.ready.wait()

    @property
    def request_id(self) -> int:
        """The core's id for this request."""
        return self.ticket.request_id

    def cut(self, reason: str) -> None:
        """End the reply now with a visible notice (`shutdown`); the read stops, upstream aborts."""
        if not self.ticket.admitted.done():
            self.ticket.admitted.set_exception(Expiry(reason))
            self.ticket.admitted.exception()
        elif self._cut is None:
            self._cut = reason
            if self._scope is not None:
                self._scope.cancel()

    async def close(self, reason: str = "cancelled") -> None:
        """Abandon the request (client gone or stalled): abort upstream, release the ticket."""
        if self._reader is None:
            self._finish_without_reader("cancelled")
            return
        if not self._reader.done():
            self._cut = self._cut or reason
            self._reader.cancel()
            await asyncio.wait([self._reader])

    def _on_expire(self, reason: str) -> None:
        if self._cut is None:
            self._cut = reason
        if self._scope is not None:
            self._scope.cancel()

    def _finish_without_reader(self, outcome: Outcome) -> None:
        self.ctx.policy.release(self.ticket, outcome)
        if self.end == "running":
            self.end = self.ticket.expired or outcome
        self._done()

    def _done(self) -> None:
        if self.done.is_set():
            return
        self.ctx.sessions.discard(self)
        self.window.close()
        self.ready.set()
        self.done.set()
        self.ctx.metrics.request_ended(self)

    async def _read(self) -> None:
        outcome: Outcome = "cancelled"
        try:
            with anyio.CancelScope() as scope:
                self._scope = scope
                self.ticket.on_expire = self._on_expire
                if self.ticket.expired is not None:
                    self._on_expire(self.ticket.expired)
                elif self._cut is not None:  # cut between admission and this task's start
                    scope.cancel()
                await self._pump()
                outcome = "completed"
            if self._cut is not None:
                outcome = await self._on_cut(self._cut)
        except UpstreamError as exc:
            outcome = "error"
            self._fail(exc)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            outcome = "error"
            self._fail(UpstreamError(502, "backend_error", f"backend sent bad data: {exc}"))
        finally:
            await self._close_upstream()
            self.ctx.policy.release(self.ticket, outcome)
            if self.end == "running":
                self.end = self._cut or outcome
            self._done()

    async def _pump(self) -> None:
        route = self.ctx.routes[self.ticket.backend or ""]
        body = self.prepared.body
        if route.priority_scheduling:
            body = {**body, "priority": self.ticket.priority}
        try:
            self._stream = await self.ctx.upstream.open(
                route.url, self.prepared.path, body, f"llmflow-{self.request_id}"
            )
        except UpstreamError as exc:
            if exc.backend_down:
                self.ctx.on_backend_down(self.ticket.backend or "", exc.message)
            raise
        async for data in self._stream.events():
            chunk, new_tokens = self.parser.feed(data)
            if new_tokens:
                self._on_tokens(new_tokens)
            if chunk is not None:
                await self._emit(chunk)
        self._upstream_complete = True

    def _on_tokens(self, n: int) -> None:
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
            self.ctx.policy.first_token(self.ticket)
            self.ctx.metrics.first_token(self)
            self.ready.set()
        self.ctx.policy.tokens(self.ticket, n)

    async def _emit(self, chunk: Item) -> None:
        if self.streaming:
            await self.window.put(chunk)
        else:
            self.accumulator.add(parse_item(chunk))

    async def _on_cut(self, reason: str) -> Outcome:
        await self._close_upstream()  # abort first: vLLM frees the KV while we answer
        self.end = reason
        first_token_missing = reason == "first_token_timeout" and self.first_token_at is None
        if first_token_missing and self.ctx.first_token_error:
            self.error = GatewayError(
                504, "no first token within the first-token timeout", "first_token_timeout"
            )
            return "timeout"
        open_choices = [i for i in range(self.prepared.options.n) if i not in self.parser.finished]
        if open_choices:
            tail = tail_chunk(
                self.prepared.options, self.parser.template, open_choices, reason, self.request_id
            )
            self.ctx.metrics.truncated(reason)
            if self.streaming:
                self.window.put_final(tail)
            else:
                self.accumulator.add(tail)
        return "cancelled" if reason == "shutdown" else "timeout"

    def _fail(self, exc: UpstreamError) -> None:
        self.end = "error"
        if self.first_token_at is None or not self.streaming:
            self.error = GatewayError(exc.status, exc.message, exc.code)
        else:  # the status is already sent: report in-band, as vLLM does
            self.window.put_final({"error": in_band_error(exc)})

    async def _close_upstream(self) -> None:
        if self._stream is not None and not self._stream.closed:
            if not self._upstream_complete:
                self.ctx.metrics.upstream_aborted(self._cut or self.end)
            with anyio.CancelScope(shield=True):
                await self._stream.aclose()

    def response(self) -> Json:
        """The non-streaming reply, once `done` (partial text and notice when cut)."""
        return self.accumulator.response(self.parser.usage)


def in_band_error(exc: UpstreamError) -> Json:
    """The in-band error object for a stream that already started."""
    return {"message": exc.message, "type": "bad_gateway", "code": exc.code}
