"""Streams through the Rust relay: the session that uses it, its host, and the hand-off reply.

A `RelayedSession` is a `StreamSession` whose upstream read and client writes run in
`llmflow._core.Relay` (tokio threads) instead of Python tasks. The session still announces
itself to the runtime and carries out its actions; what changes is where the bytes go:

- `Start` opens the request in the relay, which reads vLLM's stream, cuts usage, counts tokens
  and holds the first chunks;
- at the first token, the route's `RelayStream` takes the client's socket from uvicorn
  (`handoff.py`) and attaches it to the stream: from then on no Python runs per chunk;
- the relay reports what happens (started, first token, token counts every
  `_TOKEN_FLUSH_MS`, done, failed, window full or drained, client gone, closed) through one
  wake-up pipe; `RelayHost` feeds them to the runtime as the Python reader did;
- `Cut`, `Abort` and `End` go back to the relay as controls (the notice and the in-band error
  are rendered here, in Python, from the same helpers as before).

A session that is cut before its relay stream opens falls back to the Python path, which
knows how to end a reply that never started. A split (P/D) request's reader task sends its
prefill hop first and then hands the decode hop to the relay (`RelayedSession._hand_over`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from typing import TYPE_CHECKING

from starlette.responses import Response

from llmflow._core import InvalidArgumentError, Relay
from llmflow.gateway.handoff import handoff_of
from llmflow.gateway.session import StreamSession, in_band_error, reply_error, upstream_body
from llmflow.gateway.streaming import encode_event, tail_chunk
from llmflow.gateway.upstream import UpstreamError

if TYPE_CHECKING:
    from collections.abc import Callable

    from llmflow._core import RelayEvent, Reply
    from llmflow.config import Settings
    from llmflow.gateway.handoff import TakenSocket
    from llmflow.gateway.host import Host
    from llmflow.gateway.session import BackendRoute, Prepared, SessionContext
    from llmflow.gateway.types import Json, Receive, Scope, Send

__all__ = ["RelayHost", "RelayStream", "RelayedSession"]

log = logging.getLogger("llmflow.gateway")
_TOKEN_FLUSH_MS = 20.0  # token counts reach the runtime at most this late (KV ledger, VTC)
_HEADERS = (
    b"content-type: text/event-stream; charset=utf-8\r\n"
    b"cache-control: no-cache\r\n"
    b"x-accel-buffering: no\r\n"
    b"transfer-encoding: chunked\r\n"
)


class RelayHost:
    """The relay, its wake-up pipe, and the sessions it streams.

    Args:
        host: the runtime host the relay's events are fed to.
        settings: the gateway's config (window, pause, flush interval, workers).
    """

    def __init__(self, host: Host, settings: Settings) -> None:
        self.host = host
        read_end, write_end = os.pipe()
        os.set_blocking(read_end, False)
        os.set_blocking(write_end, False)
        self._wake_fd = read_end
        self.relay = Relay(
            write_end,
            threads=settings.server.workers,
            client_window=settings.backpressure.client_window,
            pause_when_full=settings.backpressure.pause_when_full,
            flush_interval_ms=settings.streaming.sse_flush_interval,
            token_flush_ms=_TOKEN_FLUSH_MS,
            max_event_bytes=settings.server.max_event_bytes,
        )
        self.sessions: dict[int, RelayedSession] = {}
        self.draining = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._by_kind: dict[str, Callable[[RelayEvent], None]] = {
            "tokens": self._tokens,
            "started": lambda e: self._session(e).relay_started(),
            "first_token": lambda e: self._session(e).relay_first_token(e[2], e[3]),
            "done": lambda e: self._session(e).relay_done(),
            "failed": lambda e: self._session(e).relay_failed(e[2], e[3], e[4], e[5], e[6]),
            "window_full": lambda e: self._session(e).window_full(),
            "window_drained": lambda e: self._session(e).window_drained(),
            "client_gone": lambda e: self._session(e).relay_client_gone(),
            "closed": self._closed,
        }

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

    def open(self, session: RelayedSession, url: str, body: bytes) -> None:
        """Send a session's request upstream through the relay."""
        rid = session.request_id
        include_usage = session.prepared.options.include_usage
        self.relay.open(
            rid, url, body, f"llmflow-{rid}", include_usage, deferred=True,
            traceparent=session.traceparent(),
        )
        self.sessions[rid] = session
        # Sent on the loop's next turn, as a Python reader task would send it: what this turn
        # closed (the abort that freed the slot it takes) reaches the backend first.
        assert self._loop is not None
        self._loop.call_soon(self.relay.go, rid)

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError):  # woken by an earlier batch's byte
            os.read(self._wake_fd, 4096)
        for event in self.relay.events():
            self._by_kind[event[0]](event)

    def _session(self, event: RelayEvent) -> RelayedSession:
        return self.sessions[event[1]]

    def _tokens(self, event: RelayEvent) -> None:
        self.host.tokens_many(event[1])

    def _closed(self, event: RelayEvent) -> None:
        _, rid, fd, complete, tokens = event
        session = self.sessions.pop(rid)
        session.parser.completion_tokens = tokens  # the relay's own count, for the metrics
        if fd is not None:
            taken = session.taken
            if taken is not None and not self.draining:
                taken.adopt(fd)
            else:
                os.close(fd)
        session.relay_closed(complete)


class RelayedSession(StreamSession):
    """A session whose bytes move in the Rust relay (see the module docstring).

    Args:
        ctx: shared runtime.
        prepared: the validated request (streaming, one choice, no continuous usage).
        relay_host: the relay.
    """

    def __init__(self, ctx: SessionContext, prepared: Prepared, relay_host: RelayHost) -> None:
        super().__init__(ctx, prepared)
        self.relay_host = relay_host
        self.relay = relay_host.relay
        self.opened = False  # the relay has the request (else the Python path serves it)
        self.taken: TakenSocket | None = None
        self._template: str | None = None
        self._upstream_started = False
        self._relay_after_hop = False  # split: the reader task runs the prefill hop first

    # ---- the runtime's actions ---------------------------------------------------------------

    def _begin(self) -> None:
        route = self.ctx.routes[self.backend or ""]
        # Cut between admission and now, or a backend the relay cannot speak to (https): the
        # Python path serves it (and writes the end of a reply that never started).
        if self._stop or not route.url.startswith("http://"):
            super()._begin()
            return
        start = self.start_action
        if start is not None and start.prefill_backend is not None:
            # Split: the Python reader task sends the prefill hop (one request, not per
            # chunk), then hands the decode hop to the relay (`_hand_over`).
            self._relay_after_hop = True
            super()._begin()
            return
        if not self._open_relay(route, upstream_body(self.prepared, route, start)):
            super()._begin()

    def _open_relay(self, route: BackendRoute, body: Json) -> bool:
        """Send the request upstream through the relay; False if the relay cannot."""
        url = route.url + self.prepared.path
        try:
            self.relay_host.open(self, url, json.dumps(body).encode())
        except InvalidArgumentError:  # a URL the relay cannot parse
            log.warning(
                "relay cannot open %s; streaming request %d through Python", url, self.request_id
            )
            return False
        self.opened = True
        return True

    def _hand_over(self, route: BackendRoute, body: Json) -> bool:
        # Split: the prefill hop has answered; the relay's events end the request from now on.
        return self._relay_after_hop and self._open_relay(route, body)

    def on_abort(self) -> None:
        if not self.opened:
            super().on_abort()
            return
        self.relay.abort(self.request_id)

    def on_reply(self, action: Reply) -> None:
        if not self.opened:
            super().on_reply(action)
            return
        self._ended = True
        self.end = action.reason
        self.error = reply_error(action, self._upstream_error)
        self.relay.close(self.request_id)
        self.ready.set()

    def on_cut(self, reason: str) -> None:
        if not self.opened:
            super().on_cut(reason)
            return
        self._ended = True
        self.end = reason
        rid = self.request_id
        if reason == "client_stall":
            self.relay.cut(rid, None)
        elif reason == "upstream_error":
            assert self._upstream_error is not None
            self.relay.cut(rid, encode_event({"error": in_band_error(self._upstream_error)}))
        else:
            template = json.loads(self._template) if self._template else None
            tail = tail_chunk(self.prepared.options, template, [0], reason, rid)
            self.ctx.metrics.truncated(reason)
            self.relay.cut(rid, encode_event(tail), only_if_open=True)
        self.ready.set()

    def on_end(self, outcome: str) -> None:
        if not self.opened:
            super().on_end(outcome)
            return
        self._ended = True
        self.end = outcome
        if outcome != "completed":
            self.relay.close(self.request_id)

    async def close(self) -> None:
        """The reply will not be relayed (an error, or the client left before it started)."""
        if not self.opened:
            await super().close()
            return
        if not self._ended:
            self.ctx.host.client_gone(self.request_id)
        self.relay.close(self.request_id)  # a stream cut before the hand-off waits for none

    # ---- the relay's events ------------------------------------------------------------------

    def relay_started(self) -> None:
        self._upstream_started = True
        self.ctx.host.started(self.request_id)

    def relay_first_token(self, n: int, template: str | None) -> None:
        self._template = template
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
            self.ctx.metrics.first_token(self)
        self.ready.set()
        self.ctx.host.tokens(self.request_id, n)

    def relay_done(self) -> None:
        self._upstream_complete = True
        if not self._ended:
            self.end = "completed"
            self.ctx.host.done(self.request_id)

    def relay_failed(
        self, status: int, code: str, message: str, backend_down: bool, error: str | None
    ) -> None:
        self._upstream_error = UpstreamError(
            status,
            code,
            message,
            backend_down=backend_down,
            error=json.loads(error) if error is not None else None,
        )
        if not self._ended:
            self.ctx.host.failed(self.request_id, status, backend_down)

    def relay_client_gone(self) -> None:
        if not self._ended:
            self.ctx.host.client_gone(self.request_id)

    def relay_closed(self, upstream_complete: bool) -> None:
        if self._upstream_started and not upstream_complete:
            self.ctx.metrics.upstream_aborted(self.end)
        if not self._ended:  # the relay ended it on its own (cannot happen unless a bug)
            log.warning("relay closed request %d before the runtime ended it", self.request_id)
            self.ctx.host.client_gone(self.request_id)
        self._done()

    def attach(self, scope: Scope) -> None:
        """Give the relay the client's socket (the reply is the relay's from now on)."""
        take = handoff_of(scope)
        taken = take() if take is not None else None
        if taken is None:  # the connection is closing: nobody reads this reply
            if not self._ended:
                self.ctx.host.client_gone(self.request_id)
            self.relay.close(self.request_id)
            return
        self.taken = taken
        head = b"HTTP/1.1 200 OK\r\n" + _HEADERS
        head += f"x-request-id: llmflow-{self.request_id}\r\n".encode()
        if taken.close_header:
            head += b"connection: close\r\n"
        if not self.relay.attach(self.request_id, taken.fd, head + b"\r\n", taken.keep_alive):
            self.taken = None  # the stream had ended: the relay closed the socket


class RelayStream(Response):
    """The reply of a relayed session: hands the connection to the relay and returns.

    A `Response` only so that FastAPI passes it through untouched; it never renders a body.
    """

    def __init__(self, session: RelayedSession) -> None:
        self.session = session
        self.status_code = 200
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.session.attach(scope)


def relayable(scope: Scope, prepared: Prepared) -> bool:
    """True when this request can stream through the relay (given that one runs)."""
    options = prepared.options
    return (
        options.stream
        and options.n == 1
        and not options.continuous_usage
        and handoff_of(scope) is not None
    )
