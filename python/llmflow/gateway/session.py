"""One governed request: the upstream reader, and the runtime's actions carried out on it.

A session announces itself to the runtime (`Host.arrive`) and then does what the runtime says:
`on_start` opens the upstream stream and reads it in a task of its own into the client's bounded
`ChunkWindow` (a WebSocket's: HTTP requests are the native front's); `on_reply` answers with a
status; `on_cut` stops the read and ends the reply with the visible notice; `on_abort` closes
upstream (vLLM aborts and frees the KV at once); `on_end` marks it over. What happens on the
wire goes back as events: started, tokens, done, failed, window full or drained, client gone.
The session decides nothing itself: every status, Retry-After and cut is the runtime's.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio

from llmflow.gateway.backpressure import ChunkWindow
from llmflow.gateway.disagg import decode_body, prefill_hop
from llmflow.gateway.errors import GatewayError
from llmflow.gateway.signals import NO_SIGNALS, ClientSignals
from llmflow.gateway.streaming import ChunkParser, MalformedChunk, tail_chunk
from llmflow.gateway.upstream import UpstreamError

if TYPE_CHECKING:
    from llmflow._core import Reply, Start
    from llmflow.gateway.host import Host
    from llmflow.gateway.http1 import Connection
    from llmflow.gateway.metrics import GatewayMetrics
    from llmflow.gateway.shadow import Verdict
    from llmflow.gateway.streaming import ClientOptions, Item
    from llmflow.gateway.telemetry import Tracing
    from llmflow.gateway.types import Json
    from llmflow.gateway.upstream import Upstream, UpstreamStream

__all__ = ["BackendRoute", "Prepared", "SessionContext", "StreamSession", "upstream_body"]

log = logging.getLogger("llmflow.gateway")

# What each refusal says to the client; the status and Retry-After are the runtime's.
_LATER = "; retry after the Retry-After header's seconds"
_MESSAGES = {
    "queue_full": "the gateway's queue is full" + _LATER,
    "tier_shed": "the queue is too full for this API key's tier (tiers[].shed_at)" + _LATER,
    "kv_pressure": "the backends' KV cache is nearly full (kv.pressure_threshold)" + _LATER,
    "ttft_sla": "the work queued ahead would make this request miss its first-token target "
    "(sla.ttft_ms)" + _LATER,
    "preemption_breaker": "the backends are preempting requests: fewer are let wait "
    "(preemption)" + _LATER,
    "no_healthy_backend": "no healthy backend serves this model" + _LATER,
    "draining": "the gateway is shutting down and takes no new requests; retry elsewhere or "
    "after the Retry-After header's seconds",
    "displaced": "request displaced from the queue by a more important request or by a tenant "
    "holding less than its fair share of the waiting places; retry later",
    "queue_timeout": "queue wait expired (queue_timeout)",
    "rate_limited": "over this API key's rate limit (requests per second or tokens per minute); "
    "retry after the Retry-After header's seconds",
    "deadline": "queue wait expired (deadline)",
    "first_token_timeout": "no first token within the first-token timeout",
    "shutdown": "the gateway is shutting down",
    "client_deadline": "the queue ahead would not start this request before the client's own "
    "deadline (x-llmflow-deadline-ms, or the SDK's timeout; signals.min_deadline_ms)" + _LATER
    + ", or allow a longer deadline",
}


# The body's output bound, by endpoint: Responses, chat (its newer name), else `max_tokens`.
_OUTPUT_BOUNDS = ("max_output_tokens", "max_completion_tokens")


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
    model: str | None = None  # the served model it routes to (an alias resolved)
    prefix_hashes: list[int] | None = None  # its prompt's block hashes, for a `prefix` pool
    # The body's fingerprint (`body_fingerprint`), by which the core knows a client's retry.
    fingerprint: int = 0
    traceparent: str | None = None  # the client's W3C `traceparent`: its span continues it
    signals: ClientSignals = NO_SIGNALS  # what its headers say: a retry, its client's deadline
    # Sent upstream as the client sent it, not streamed (what vLLM computes only for a reply
    # it does not stream: prompt logprobs); its answer goes to the client as vLLM wrote it.
    unstreamed: bool = False
    arrived: float = field(default_factory=time.monotonic)


def body_fingerprint(raw: bytes) -> int:
    """A request body's fingerprint for the core's retry memory: 64 bits of BLAKE2b keyed with
    this process's random key (never 0, which means none). A client that retries sends the
    same bytes. Keyed because the fingerprint reaches the trace file: an unkeyed checksum
    (the CRC-32 it was) of a body with a short secret in it (a 4-digit PIN) gave the secret
    to anyone who tried every value, in 51 ms. Keyed BLAKE2b costs 66 us on a 64 KiB body,
    2.3 us on a 2 KiB one (this VM, `python -m timeit`)."""
    digest = hashlib.blake2b(raw, digest_size=8, key=_FINGERPRINT_KEY).digest()
    return int.from_bytes(digest, "little") or 1


_FINGERPRINT_KEY = secrets.token_bytes(32)  # per process: the trace replays what it recorded


def fingerprint_key() -> bytes:
    """This process's fingerprint key (the native front fingerprints bodies with it too)."""
    return _FINGERPRINT_KEY


def upstream_body(prepared: Prepared, route: BackendRoute, start: Start | None) -> Json:
    """The body sent to vLLM: the prepared one, with the core's priority when the backend
    schedules by priority, and `max_tokens` clamped when the core browned the request out."""
    body = prepared.body
    if start is None:
        return body
    if route.priority_scheduling:
        body = {**body, "priority": start.priority}
    if start.max_tokens is not None:
        key = next((k for k in _OUTPUT_BOUNDS if k in body), "max_tokens")
        body = {**body, key: start.max_tokens}
    return body


@dataclass(slots=True)
class SessionContext:
    """What every session shares: the runtime host, the client, routes, settings, registries."""

    host: Host
    upstream: Upstream
    routes: dict[str, BackendRoute]
    metrics: GatewayMetrics
    client_window: int
    pause_when_full: bool
    tracing: Tracing | None = None  # OpenTelemetry spans (`telemetry.py`), when configured
    sessions: set[StreamSession] = field(default_factory=set)
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)


def request_id_header(request_id: int) -> dict[str, str]:
    """`X-Request-Id`, as sent upstream and named in the runtime's trace (`llmflow-<id>`)."""
    return {"X-Request-Id": f"llmflow-{request_id}"}


def reply_error(reply: Reply, upstream: UpstreamError | None = None) -> GatewayError:
    """The client's error for a runtime `Reply`: its status and Retry-After, our message."""
    headers = request_id_header(reply.request_id)
    if reply.retry_after_s is not None:
        headers["Retry-After"] = str(reply.retry_after_s)
    if reply.reason == "upstream_error" and upstream is not None:
        own = upstream.error if reply.status == upstream.status else None  # vLLM's refusal
        return GatewayError(
            reply.status, upstream.message, upstream.code, headers=headers, upstream=own
        )
    message = _MESSAGES.get(reply.reason) or f"request refused: {reply.reason.replace('_', ' ')}"
    return GatewayError(reply.status, message, reply.reason, headers=headers)


class StreamSession:
    """The lifetime of one governed request.

    Args:
        ctx: shared runtime.
        prepared: the validated request.
    """

    until_done = True  # upstream's stream ends with `data: [DONE]`

    def __init__(self, ctx: SessionContext, prepared: Prepared) -> None:
        self.ctx, self.prepared = ctx, prepared
        self.request_id = ctx.host.new_id()
        options = prepared.options
        self.parser = ChunkParser(options)
        self.window = ChunkWindow(ctx.client_window, ctx.pause_when_full)
        self.admitted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.ready = asyncio.Event()  # first token arrived, or the read ended
        self.done = asyncio.Event()  # the read ended and the request is over
        self.error: GatewayError | None = None  # answer with a status instead of a body
        self.end = "running"  # completed, error, deadline, first_token_timeout, cancelled, ...
        self.backend: str | None = None
        self.priority = 0
        self.start_action: Start | None = None  # the runtime's Start, once admitted
        self.queue_wait_s = 0.0
        self.first_token_at: float | None = None
        self.ended_at: float | None = None  # monotonic, when it ended (`_done`)
        self.cancel_writer: Any = None  # set by the writer: called when the client stalls
        self.shadow: Verdict | None = None  # shadow mode: what the policy runtime did with it
        self.answer: Json | None = None  # vLLM's whole answer to an unstreamed request
        self._ended = False  # the runtime sent this request's terminal action
        self._arriving = False  # inside `arrive`: a refusal now is counted as a rejection
        self._stream: UpstreamStream | None = None
        self._conn: Connection | None = None  # the upstream connection, once there is one
        self._scope: anyio.CancelScope | None = None
        self._stop = False  # the read must stop (cut, abort, reply, client gone)
        self._reader: asyncio.Task[None] | None = None
        self._upstream_complete = False
        self._upstream_error: UpstreamError | None = None
        ctx.sessions.add(self)
        self.window.on_full = self.window_full
        self.window.on_drained = self.window_drained

    @property
    def id_header(self) -> dict[str, str]:
        """`X-Request-Id` for the reply: the id upstream and the trace know it by."""
        return request_id_header(self.request_id)

    def traceparent(self) -> str | None:
        """W3C `traceparent` for the upstream request (it opens the upstream span), if tracing."""
        tracing = self.ctx.tracing
        return tracing.upstream_began(self) if tracing is not None else None

    @property
    def streaming(self) -> bool:
        """True when the client asked for SSE."""
        return self.prepared.options.stream

    @property
    def tier(self) -> str:
        """The tier its tenant belongs to."""
        return self.prepared.tier

    @property
    def queued(self) -> bool:
        """True while the request waits for a slot."""
        return not self.admitted.done()

    def arrive(self) -> None:
        """Announce the request to the runtime.

        Raises:
            GatewayError: the runtime refused it at once (429/503 with Retry-After).
        """
        p = self.prepared
        self._arriving = True
        try:
            self.ctx.host.arrive(
                self,
                self.request_id,
                p.tenant,
                p.prompt_tokens,
                p.max_tokens,
                p.options.stream,
                model=p.model,
                prefix_hashes=p.prefix_hashes,
                fingerprint=p.fingerprint,
                signals=p.signals,
            )
        finally:
            self._arriving = False
        error = self.admitted.exception() if self.admitted.done() else None
        if error is not None:
            raise error

    async def start(self) -> None:
        """Wait for the runtime to start the request; return at the first token or the end.

        Raises:
            GatewayError: the runtime answered with a status (refused, queue wait expired,
                displaced, shutting down).
        """
        await self.admitted
        self._begin()
        await self.ready.wait()

    def _begin(self) -> None:
        """Start reading upstream (in a task of this session's own)."""
        self._reader = asyncio.create_task(self._read(), name=f"llmflow-read-{self.request_id}")
        self.ctx.tasks.add(self._reader)
        self._reader.add_done_callback(self.ctx.tasks.discard)

    async def close(self) -> None:
        """The client is gone (or its writer finished): tell the runtime, wait for the read."""
        if not self._ended:
            self.ctx.host.client_gone(self.request_id)
        if self._reader is not None and not self._reader.done():
            await asyncio.wait([self._reader])

    # ---- the runtime's actions ---------------------------------------------------------------

    def on_start(self, action: Start) -> None:
        self.backend, self.priority = action.backend, action.priority
        self.start_action = action
        self.queue_wait_s = action.queue_wait_s
        if not self.admitted.done():
            self.admitted.set_result(None)

    def on_abort(self) -> None:
        self._stop_reading()

    def on_reply(self, action: Reply) -> None:
        self._ended = True
        error = reply_error(action, self._upstream_error)
        self.end = action.reason
        if not self.admitted.done():
            self.admitted.set_exception(error)
            self.admitted.exception()  # retrieved: an abandoned session must not log a warning
            self._done()
            return
        self.error = error
        self._stop_reading()
        self.ready.set()

    def on_cut(self, reason: str) -> None:
        self._ended = True
        self.end = reason
        self._stop_reading()
        if reason == "client_stall":
            if self.cancel_writer is not None:
                self.cancel_writer()
            return
        if reason == "upstream_error":
            assert self._upstream_error is not None
            self.window.put_final({"error": in_band_error(self._upstream_error)})
            return
        options = self.prepared.options
        for held in self.parser.take_held(every=True):  # finished choices' last chunks
            self._emit_final(held)
        open_choices = [i for i in range(options.n) if i not in self.parser.finished]
        if open_choices:
            tail = tail_chunk(options, self.parser.template, open_choices, reason, self.request_id)
            self.ctx.metrics.truncated(reason)
            self.window.put_final(tail)
        self.ready.set()

    def on_end(self, outcome: str) -> None:
        self._ended = True
        self.end = outcome
        if outcome != "completed":
            self._stop_reading()
        if self._reader is None:
            self._done()

    # ---- the read ----------------------------------------------------------------------------

    def _stop_reading(self) -> None:
        self._stop = True
        if self._conn is not None and not self._upstream_complete:
            self._conn.shut_down_now()  # before the runtime's next Start reaches the backend
        if self._scope is not None:
            self._scope.cancel()

    def _done(self) -> None:
        if self.done.is_set():
            return
        self.ended_at = time.monotonic()
        self.ctx.sessions.discard(self)
        self.window.close()
        self.ready.set()
        self.done.set()
        if not self._arriving:
            self.ctx.metrics.request_ended(self)

    async def _read(self) -> None:
        host = self.ctx.host
        try:
            with anyio.CancelScope() as scope:
                self._scope = scope
                if self._stop:  # cut between admission and this task's start
                    scope.cancel()
                await self._pump()
            if not self._ended and self._upstream_complete:
                self.end = "completed"
                host.done(self.request_id)  # may linger in the runtime while the client owes
        except UpstreamError as exc:
            self._upstream_error = exc
            host.failed(self.request_id, exc.status, exc.backend_down)
        except MalformedChunk as exc:
            self._upstream_error = UpstreamError(502, "backend_error", str(exc))
            host.failed(self.request_id, 502, False)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            self._upstream_error = UpstreamError(
                502, "backend_error", f"backend sent bad data: {exc}"
            )
            host.failed(self.request_id, 502, False)
        except Exception:  # whatever else a reply provokes: this request's failure,
            # never a clean end with the text cut short
            log.exception("request %d: reading the backend's reply failed", self.request_id)
            self._upstream_error = UpstreamError(
                502, "backend_error", "the gateway could not read the backend's reply"
            )
            host.failed(self.request_id, 502, False)
        finally:
            await self._close_upstream()
            if not self._ended and not self._upstream_complete:  # the task was cancelled
                host.client_gone(self.request_id)
            self._done()

    async def _pump(self) -> None:
        """Send the request and read its stream."""
        route = self.ctx.routes[self.backend or ""]
        body = await self._upstream_request(route)
        if self._stop:
            return
        await self._stream_from(route, body)

    async def _upstream_request(self, route: BackendRoute) -> Json:
        """The body to send `route`: after the prefill hop, for a split request."""
        start = self.start_action
        body = upstream_body(self.prepared, route, start)
        if start is not None and start.prefill_backend is not None:
            body = await self._prefill_hop(start, body)
        return body

    async def _stream_from(self, route: BackendRoute, body: Json) -> None:
        """Send the request to `route` and read its stream into the sink."""
        if self.prepared.unstreamed:
            await self._answer_from(route, body)
            return
        host, rid = self.ctx.host, self.request_id
        self._stream = await self.ctx.upstream.open(
            route.url, self.prepared.path, body, self.id_header["X-Request-Id"], self._on_conn,
            traceparent=self.traceparent(),
        )
        host.started(rid)
        async for data in self._stream.events(self.until_done):
            if self._stop:  # cut or aborted: events already read must not follow the tail
                return
            chunk, new_tokens = self.parser.feed(data)
            if isinstance(chunk, dict) and "error" in chunk:
                raise error_event(chunk)  # vLLM's in-band 500: a failure, not a chunk
            for held in self.parser.take_held():  # a last chunk, stamped with the fingerprint
                await self._emit(held)
            if new_tokens:
                if self.first_token_at is None:
                    self.first_token_at = time.monotonic()
                    self.ctx.metrics.first_token(self)
                    self.ready.set()
                host.tokens(rid, new_tokens)
            if chunk is not None:
                await self._emit(chunk)
        for held in self.parser.take_held(every=True):
            await self._emit(held)
        self._upstream_complete = True

    async def _answer_from(self, route: BackendRoute, body: Json) -> None:
        """Send an unstreamed request (`Prepared.unstreamed`) and keep vLLM's answer whole.

        The runtime hears its tokens all at once, from the answer's usage, when it comes: a
        cut before then (a deadline, the first-token timeout, the drain) has no partial text
        to return, only the notice."""
        host, rid = self.ctx.host, self.request_id
        answer = await self.ctx.upstream.post_json(
            route.url, self.prepared.path, body, self.id_header["X-Request-Id"], self._on_conn
        )
        if self._stop:
            return
        host.started(rid)
        usage = answer.get("usage")
        tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
        self.parser.usage = usage if isinstance(usage, dict) else None
        if isinstance(tokens, int) and tokens > 0:
            self.parser.completion_tokens = tokens
            host.tokens(rid, tokens)
        self.answer = answer
        self._upstream_complete = True

    async def _prefill_hop(self, start: Start, body: Json) -> Json:
        """P/D: send the prefill hop (`disagg.py`; the client's body, with the hop's own
        priority where its instance schedules by priority), tell the runtime it answered, and
        return the decode hop's body (`body`, the decode's, with the KV transfer parameters)."""
        assert start.prefill_backend is not None
        route = self.ctx.routes[start.prefill_backend]
        hop = self.prepared.body
        if route.priority_scheduling:
            hop = {**hop, "priority": start.prefill_priority}
        params = await prefill_hop(
            self.ctx.upstream, route.url, self.prepared.path, hop,
            self.id_header["X-Request-Id"], self._on_conn,
        )
        self._conn = None  # back in the pool: an abort from now on is the decode's to close
        self.ctx.host.prefilled(self.request_id)
        return decode_body(body, params)

    def _on_conn(self, conn: Connection) -> None:
        self._conn = conn
        if self._stop:  # stopped while connecting: the request must not reach the backend
            conn.shut_down_now()

    def _emit_final(self, chunk: Json) -> None:
        self.window.put_final(chunk)

    async def _emit(self, chunk: Item) -> None:
        await self.window.put(chunk)

    def window_full(self) -> None:
        """The client's window of unacknowledged chunks is full (the stall timer runs)."""
        if not self._ended:
            self.ctx.host.window_full(self.request_id)

    def window_drained(self) -> None:
        """The client took chunks: its window has room again."""
        if not self._ended:
            self.ctx.host.window_drained(self.request_id)

    async def _close_upstream(self) -> None:
        if self._stream is not None and not self._stream.closed:
            if not self._upstream_complete:
                self.ctx.metrics.upstream_aborted(self.end)
            with anyio.CancelScope(shield=True):
                await self._stream.aclose()


def error_event(chunk: Json) -> UpstreamError:
    """The failure a backend reports in-band (vLLM's `data: {"error": ...}` under a started
    stream, followed by `[DONE]`): the request failed, whatever the `[DONE]` says.

    A 4xx `code` is vLLM refusing the request (a parameter it checks only once the stream has
    begun, e.g. `logprobs` over its maximum): the client's error, with vLLM's object, which the
    runtime answers with that status before the first token. Anything else is the backend
    failing (502). The relay's twin is `in_band_failure` in `rust/src/relay/chunk.rs`."""
    error = chunk["error"]
    message = error.get("message") if isinstance(error, dict) else error
    status = error.get("code") if isinstance(error, dict) else None
    if isinstance(status, int) and 400 <= status < 500:
        return UpstreamError(status, "backend_rejected", str(message), error=error)
    return UpstreamError(502, "backend_error", f"backend failed mid-stream: {message}")


def in_band_error(exc: UpstreamError) -> Json:
    """The in-band error object for a stream that already started (vLLM's own, when it
    refused the request)."""
    if exc.error is not None:
        return exc.error
    return {"message": exc.message, "type": "bad_gateway", "code": exc.code}
