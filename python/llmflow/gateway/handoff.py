"""Socket hand-off: uvicorn lends a streaming reply's connection to the Rust relay.

FastAPI stays the front: routes, validation, auth, errors, WebSocket and the dashboard run
under uvicorn as before. Only a streaming reply, once its first token is ready, leaves
Python: the route takes the client's socket from uvicorn (`llmflow.handoff` in the ASGI
scope's extensions), and the relay writes the head and every chunk itself, with no Python on
the per-chunk path. When the reply ends cleanly on a keep-alive connection, the relay hands
the socket back and `adopt` starts a fresh uvicorn protocol on it, so the client's next
request is served as if nothing had happened.

The extension exists only under `HandoffProtocol` (uvicorn with httptools, HTTP/1.1); under
any other server the gateway streams through Python as before.

The protocol also guards what httptools alone would not: a request's line and headers are
bounded (`limits.max_header_bytes`, passed as uvicorn's `h11_max_incomplete_event_size` by
`listener.py`), and a request it cannot parse gets an OpenAI-style body instead of uvicorn's
plain text.

The protocol also guards the listener, below any request (so below the runtime): a client
must send its whole request within `read_timeout_s` (uvicorn has no such timer, so a
slowloris client held its connection for ever), and a connection accepted when file
descriptors are nearly gone is answered with a 503 and closed, keeping a reserve for the
backends' connections instead of leaving clients in the accept backlog.

And it answers a flood's refusals without FastAPI: a small completion request is held until
its body is in, and when the runtime refuses it at once its 429 is written here (`fastpath.py`);
any other request goes on to uvicorn as if it had never been held.
"""

from __future__ import annotations

import contextlib
import http
import logging
import os
import resource
import socket
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from llmflow.gateway.contract import TRANSPORT_RETRY_AFTER_S, reason_header
from llmflow.gateway.errors import error_bytes

if TYPE_CHECKING:
    import asyncio

    from llmflow.gateway.fastpath import Held, RefusalDesk
    from llmflow.gateway.types import Scope

__all__ = ["EXTENSION", "HandoffProtocol", "TakenSocket", "handoff_of"]

EXTENSION = "llmflow.handoff"
_SEND_BUFFER_BYTES = 64 * 1024  # per relayed reply; SSE chunks are a few hundred bytes
_HEAD_BYTES = 32 * 1024  # request line plus headers, when the server config names no limit
_HEADER_OVERHEAD = 4  # ": " and CRLF around each header
_FD_RESERVE = 64  # descriptors kept for upstream connections, scrapes and the relay
_OUT_OF_FDS = (
    b'{"error":{"message":"the gateway has no file descriptors left for new connections; '
    b'retry shortly","type":"server_error","param":null,"code":"too_many_connections"}}'
)
_TIMED_OUT = (
    b'{"error":{"message":"the request was not received in time: send the headers and the '
    b'body without pausing","type":"invalid_request_error","param":null,'
    b'"code":"request_timeout"}}'
)
log = logging.getLogger("llmflow.gateway")


class _HeadTooLarge(Exception):
    """Raised inside the parser's callback to stop it before the request reaches the app."""


class _PipelineTooDeep(Exception):
    """Raised inside the parser's callback: more requests are pipelined than are queued."""


MAX_PIPELINE = 16  # requests one connection may have queued behind the one being answered


_LINGER_S = 2.0  # after an error, how long the rest of a refused upload is read and dropped


@dataclass(slots=True)
class TakenSocket:
    """A client connection taken from uvicorn: the relay owns `fd` now.

    `keep_alive`: the relay hands the connection back after the reply. `close_header`: the
    reply's head says `connection: close`. They differ for a spliced reply (`spliced`): one
    with requests pipelined behind it, which the relay writes into a socket pair that this
    process copies, in order, onto the client's connection, which uvicorn keeps.
    """

    fd: int
    keep_alive: bool
    protocol: HandoffProtocol
    close_header: bool = False
    spliced: bool = False

    def adopt(self, fd: int) -> None:
        """Serve the connection's next requests with a fresh uvicorn protocol."""
        self.protocol.adopt(fd)


def _error_response(
    status: bytes, body: bytes, code: bytes, retry_after: int | None = None
) -> bytes:
    head = b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\n"
    head += b"x-llmflow-reason: " + code + b"\r\n"
    if retry_after is not None:
        head += b"retry-after: " + str(retry_after).encode() + b"\r\n"
    head += b"connection: close\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n"
    return head + body


class HandoffProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol that can give its connection away (and take one back).

    It also bounds a request's head: one that grows past the limit before it ends is refused
    as soon as it does (httptools would buffer it all), and one that ends over the limit is
    refused before the app sees it; either way with 431 and an OpenAI-style body. After such
    an error the connection reads and drops what the client is still sending for a moment, so
    the client gets to read the answer instead of a reset.

    `read_timeout_s`: how long a client may take to send a request's head and body
    (`server.read_timeout_ms`; set it with `configured`). `refusals`: where a small completion
    request is held until its body is in, and answered if the runtime refuses it
    (`fastpath.py`); the rest goes on to uvicorn as if never held.
    """

    _head_open = True  # reading a request line and headers
    _head_bytes = 0  # bytes received while the head was open
    _head_too_large = False  # the parser stopped because the head passed the limit
    _discarding = False  # an error was sent: what still arrives is dropped
    _began_in_read = False  # a request began inside the read being parsed
    _pipeline_too_deep = False  # the parser stopped at MAX_PIPELINE queued requests
    _running: Any = None  # the cycle whose ASGI task runs
    _splice: socket.socket | None = None  # our end of a spliced reply's socket pair

    def data_received(self, data: bytes) -> None:
        """Feed the parser, counting what arrives while a request's head is still open."""
        if self._refuse:  # answered at once, before parsing: it costs no request
            if not self.transport.is_closing():
                log.warning("out of file descriptors: refusing a connection")
                body = _error_response(
                    b"503 Service Unavailable",
                    _OUT_OF_FDS,
                    b"too_many_connections",
                    TRANSPORT_RETRY_AFTER_S,  # no request exists for the runtime to price
                )
                self.transport.write(body)
                self.transport.close()
            return
        if self._discarding:
            return
        was_open = self._head_open
        self._began_in_read = False
        super().data_received(data)
        # All of the read is one head only if that head was open before it and no request
        # began inside it (a read that ends pipelined requests and begins another counts
        # from the next read on; the whole head is measured when it ends either way).
        if was_open and self._head_open and not self._began_in_read and not self._discarding:
            self._head_bytes += len(data)
            if self._head_bytes > self._head_limit:
                self._refuse_head()

    def on_headers_complete(self) -> None:
        """Refuse a head over the limit; otherwise go on as uvicorn does."""
        self._head_open = False
        size = len(self.url) + sum(len(n) + len(v) + _HEADER_OVERHEAD for n, v in self.headers)
        if size > self._head_limit:
            self._head_too_large = True
            raise _HeadTooLarge  # httptools stops and reports a parse error
        if self.refusals is not None:
            self._held = self.refusals.hold(self)
            if self._held is not None:
                return
        self._begin_cycle()

    def _begin_cycle(self) -> None:
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and not isinstance(cycle.transport, _Lingering):
            cycle.transport = _Lingering(self.transport, self, cycle)  # type: ignore[assignment]
        if len(self.pipeline) > MAX_PIPELINE:
            # Answer what is queued, then close: requests past the bound are never read (a
            # client learns from the close that they were not served, and may resend them).
            self.pipeline.popleft()
            self.pipeline[0][0].keep_alive = False
            self._pipeline_too_deep = self._discarding = True
            raise _PipelineTooDeep  # stop the parser inside this read too

    def _start_asgi_task(self, cycle: Any, app: Any) -> None:
        self._running = cycle  # the request whose ASGI task runs (one at a time per connection)
        super()._start_asgi_task(cycle, app)

    def on_body(self, body: bytes) -> None:
        """Keep a held request's body; pass any other to uvicorn."""
        if self._held is not None:
            self._held.body += body
        else:
            super().on_body(body)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to bytes it cannot parse, as an OpenAI-style body."""
        if self._pipeline_too_deep:
            return  # not a parse error: the parser was stopped; queued answers go out first
        if self._head_too_large:
            self._refuse_head()
            return
        self._send_error(400, f"{msg} Send a well-formed HTTP/1.1 request.", "invalid_http")

    @property
    def _head_limit(self) -> int:
        return self.config.h11_max_incomplete_event_size or _HEAD_BYTES

    def _refuse_head(self) -> None:
        message = (
            f"request line and headers are larger than the gateway's limit of "
            f"{self._head_limit} bytes (limits.max_header_bytes): send fewer or shorter headers"
        )
        self._send_error(431, message, "headers_too_large")

    def _send_error(self, status: int, message: str, code: str) -> None:
        if self.transport.is_closing() or self._discarding:
            return
        self._discarding = True
        body = error_bytes(status, message, code)
        head = [f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\n".encode()]
        for name, value in (*self.server_state.default_headers, reason_header(code)):
            head += [name, b": ", value, b"\r\n"]
        head += [
            b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body),
            b"connection: close\r\n\r\n",
        ]
        self.transport.write(b"".join(head) + body)
        self._linger()

    def _linger(self) -> None:
        # Closing a socket with unread bytes makes the kernel send a reset, which can destroy
        # the answer before the client reads it: end our side, drop what still comes, close.
        self._discarding = True
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(_LINGER_S, self.transport.close)

    read_timeout_s: float = 30.0
    write_timeout_s: float = 60.0
    refusals: RefusalDesk | None = None
    # The socket can be lent to the relay: not behind the native front door, where this
    # protocol serves a private unix socket that carries the front's connection, not the client's.
    lends = True
    _write_timer: asyncio.TimerHandle | None = None
    _held: Held | None = None  # a completion request held for the fast path
    _read_timer: asyncio.TimerHandle | None = None
    _refuse = False
    _begun = False

    @classmethod
    def configured(
        cls,
        read_timeout_s: float,
        refusals: RefusalDesk | None = None,
        write_timeout_s: float = 60.0,
        lends: bool = True,
    ) -> type[HandoffProtocol]:
        """This protocol with other read and write timeouts, and the fast path's desk if any
        (`lends`: whether a reply's socket may be lent to the relay)."""
        attributes = {
            "read_timeout_s": read_timeout_s,
            "write_timeout_s": write_timeout_s,
            "refusals": refusals,
            "lends": lends,
        }
        return type(cls.__name__, (cls,), attributes)

    def pause_writing(self) -> None:
        """The client's buffer is full: it has `write_timeout_s` to take some of it."""
        super().pause_writing()
        if self._write_timer is None:
            self._arm_write_timer(self.transport.get_write_buffer_size())

    def resume_writing(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None
        super().resume_writing()

    def _arm_write_timer(self, buffered: int) -> None:
        self._write_timer = self.loop.call_later(
            self.write_timeout_s, self._write_timed_out, buffered
        )

    def _write_timed_out(self, buffered: int) -> None:
        """Nothing taken for `write_timeout_s`: abort (the reply's handler hears it left)."""
        self._write_timer = None
        if self.transport.is_closing() and not self.transport.get_write_buffer_size():
            return
        left = self.transport.get_write_buffer_size()
        if left < buffered:  # it took some: a slow reader, not a stalled one
            self._arm_write_timer(left)
            return
        log.info("client took nothing for %.0f s: connection aborted", self.write_timeout_s)
        self.transport.abort()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        # Descriptors are handed out lowest first: a number this high means few are left.
        self._refuse = sock is not None and sock.fileno() >= limit - _FD_RESERVE
        self._arm_read_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_read_timer()
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None
        self._held = None  # it never reached the runtime
        if self._splice is not None:  # the relay, writing the other end, hears it left
            with contextlib.suppress(OSError):
                self._splice.shutdown(socket.SHUT_RDWR)
        self._running = None
        super().connection_lost(exc)
        # The protocol's reference cycles (its scope's hand-off method, its request cycle, the
        # keep-alive timer's bound method) would keep it for the cyclic GC: a flood's connections
        # closing together then cost one long collection (90 ms measured) in the middle of
        # other clients' requests, instead of being freed one by one here.
        self._unset_keepalive_if_required()
        self.scope = self.cycle = None  # type: ignore[assignment]

    def shutdown(self) -> None:
        """The server is stopping: a held request is still answered, then the socket closes."""
        if self._held is not None:
            self._held.closing = True
            return
        super().shutdown()

    def on_message_begin(self) -> None:
        self._head_open, self._head_bytes, self._began_in_read = True, 0, True
        super().on_message_begin()
        self._begun = True
        self._arm_read_timer()
        if self.lends and self.scope.get("http_version", "1.1") == "1.1":
            extensions: dict[str, Any] = {EXTENSION: self._take}
            self.scope["extensions"] = extensions

    def handle_websocket_upgrade(self) -> None:
        self._disarm_read_timer()  # the connection is the WebSocket protocol's from now on
        super().handle_websocket_upgrade()

    def on_message_complete(self) -> None:
        self._disarm_read_timer()
        self._begun = False
        held, self._held = self._held, None
        if held is not None:
            assert self.refusals is not None
            if self.refusals.answer(self, held):
                return
            self._begin_cycle()  # as if never held: uvicorn gets the head, then the body
            if held.body:
                super().on_body(bytes(held.body))
            if held.closing:
                self.cycle.keep_alive = False
        super().on_message_complete()

    def _arm_read_timer(self) -> None:
        if self._read_timer is None:
            self._read_timer = self.loop.call_later(self.read_timeout_s, self._read_timed_out)

    def _disarm_read_timer(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _read_timed_out(self) -> None:
        """The request did not arrive in time (slowloris): 408 if it began, then close."""
        self._read_timer = None
        if self.transport.is_closing():
            return
        cycle = None if self._held is not None else self.cycle  # a held request has none yet
        if self._begun and (cycle is None or not cycle.response_started):
            timed_out = _error_response(b"408 Request Timeout", _TIMED_OUT, b"request_timeout")
            self.transport.write(timed_out)
            if cycle is not None:
                cycle.disconnected = True  # the handler waiting for the body hears it left
        self.transport.close()

    def _take(self) -> TakenSocket | None:
        """Detach the socket: a duplicate of its fd goes to the caller, uvicorn forgets it.

        With another request pipelined behind this one (its bytes are uvicorn's parser's
        already), the reply is spliced instead: the caller gets one end of a socket pair,
        and what the relay writes there is copied onto the connection, which uvicorn keeps
        and goes on to answer the next request on. Returns None when the connection is
        closing.
        """
        transport, cycle = self.transport, self._running or self.cycle
        sock = transport.get_extra_info("socket")
        if cycle is None:
            return None
        if sock is None or transport.is_closing():
            cycle.disconnected = True  # the client is going: nothing to answer, nobody to tell
            return None
        if self.pipeline or self._begun or self._pipeline_too_deep:
            return self._take_spliced(cycle)
        # A stalled client holds at most this much in the kernel, not the megabytes TCP
        # autotuning would grant: the relay's window then fills when the client stops reading.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SEND_BUFFER_BYTES)
        fd = os.dup(sock.fileno())
        keep_alive = bool(cycle.keep_alive)
        cycle.disconnected = True  # uvicorn sends nothing more on this cycle (no 500 either)
        transport.pause_reading()
        transport.abort()  # closes uvicorn's fd only: the duplicate keeps the connection open
        return TakenSocket(fd, keep_alive, self, close_header=not keep_alive)

    def _take_spliced(self, cycle: Any) -> TakenSocket:
        relay_end, ours = socket.socketpair()
        relay_end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SEND_BUFFER_BYTES)
        ours.setblocking(False)
        fd = os.dup(relay_end.fileno())
        relay_end.close()
        self._splice = ours
        cycle.disconnected = True  # the cycle itself sends nothing (no 500 either)
        task = self.loop.create_task(self._copy_splice(ours, cycle))
        self.server_state.tasks.add(task)
        task.add_done_callback(self.server_state.tasks.discard)
        return TakenSocket(fd, False, self, close_header=not cycle.keep_alive, spliced=True)

    async def _copy_splice(self, ours: socket.socket, cycle: Any) -> None:
        """Copy the relayed reply onto the connection, then answer what is pipelined."""
        try:
            while data := await self.loop.sock_recv(ours, _SEND_BUFFER_BYTES):
                if self.transport.is_closing():
                    return
                self.transport.write(data)
                await cycle.flow.drain()  # the client's pace, as the relay's own socket
        except OSError:
            return
        finally:
            self._splice = None
            ours.close()
        if not cycle.keep_alive or (self._pipeline_too_deep and not self.pipeline):
            self.transport.close()
            return
        cycle.response_complete = True
        self.on_response_complete()  # the next pipelined request starts

    def adopt(self, fd: int) -> None:
        """Start a new protocol of this kind on a connection the relay handed back."""
        loop = self.loop
        sock = socket.socket(fileno=fd)

        def factory() -> HandoffProtocol:
            # This class, as configured: the read timeout and the fast path carry over.
            return type(self)(self.config, self.server_state, self.app_state, _loop=loop)

        task = loop.create_task(_adopt(loop, factory, sock))
        self.server_state.tasks.add(task)
        task.add_done_callback(self.server_state.tasks.discard)


async def _adopt(loop: asyncio.AbstractEventLoop, factory: Any, sock: socket.socket) -> None:
    try:
        await loop.connect_accepted_socket(factory, sock)
    except OSError as exc:  # the client left in between
        log.debug("handed-back connection closed: %r", exc)
        with contextlib.suppress(OSError):
            sock.close()


class _Lingering:
    """A request cycle's view of the transport: closing with the body unread lingers first.

    An early answer (413 for a body over the limit, a refusal before the body is read) is
    followed by uvicorn closing the connection while the client is still sending; without
    lingering, the client would see a reset instead of the answer.
    """

    def __init__(self, transport: asyncio.Transport, protocol: HandoffProtocol, cycle: Any) -> None:
        # Weak: the cycle holds this view, so strong references back would make every request
        # a reference cycle, left for the cyclic GC.
        self._transport = transport
        self._protocol, self._cycle = weakref.ref(protocol), weakref.ref(cycle)

    def close(self) -> None:
        """Close now, or, while the client is still sending this request's body, linger.

        Closing waits for what is buffered to be sent; a client that takes none of it within
        `_FLUSH_PROGRESS_S` (one that never reads, cut by the stall timer) is aborted, so its
        fd and the buffered reply go now, not whenever the client leaves.
        """
        cycle, protocol = self._cycle(), self._protocol()
        lingers = cycle is not None and protocol is not None and cycle.more_body
        if lingers and not self._transport.is_closing():
            protocol._linger()  # type: ignore[union-attr]
        else:
            self._transport.close()
            if protocol is not None:
                _abort_unless_flushing(self._transport, protocol.loop)

    def __getattr__(self, name: str) -> Any:
        """Everything else is the transport's."""
        return getattr(self._transport, name)


_FLUSH_PROGRESS_S = (
    1.0  # a closed connection whose buffer shrinks by nothing in this long is aborted
)


def _abort_unless_flushing(
    transport: asyncio.Transport, loop: asyncio.AbstractEventLoop, before: int | None = None
) -> None:
    """Abort a closing transport once its client has taken nothing for `_FLUSH_PROGRESS_S`."""
    left = transport.get_write_buffer_size()
    if not left:
        return
    if before is not None and left >= before:
        transport.abort()
        return
    loop.call_later(_FLUSH_PROGRESS_S, _abort_unless_flushing, transport, loop, left)


def handoff_of(scope: Scope) -> Any:
    """The scope's hand-off callable, or None when the server cannot lend its socket."""
    extensions = scope.get("extensions") or {}
    return extensions.get(EXTENSION)
