"""The gateway's uvicorn protocol: what httptools alone does not bound.

uvicorn serves the app on the private unix socket behind the native front door (`front.py`),
and the admin listener (`admin.port`) on a port of its own; both run this protocol, with the
limits `listener.server_options` gives it.

A request's line and headers are bounded (`limits.max_header_bytes`, passed as uvicorn's
`h11_max_incomplete_event_size`), and a request it cannot parse gets an OpenAI-style body
instead of uvicorn's plain text.

It also guards the listener, below any request (so below the runtime): a client must send its
whole request within `read_timeout_s` (uvicorn has no such timer, so a slowloris client held
its connection for ever), one that takes nothing of what is written to it for
`write_timeout_s` is aborted, a connection accepted when file descriptors are nearly gone is
answered with a 503 and closed (keeping a reserve for the backends' connections instead of
leaving clients in the accept backlog), and at most `MAX_PIPELINE` requests are queued behind
the one being answered.
"""

from __future__ import annotations

import http
import logging
import resource
import weakref
from typing import TYPE_CHECKING, Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from llmflow.gateway.contract import TRANSPORT_RETRY_AFTER_S, reason_header
from llmflow.gateway.errors import error_bytes

if TYPE_CHECKING:
    import asyncio

__all__ = ["MAX_PIPELINE", "GuardProtocol"]

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


def _error_response(
    status: bytes, body: bytes, code: bytes, retry_after: int | None = None
) -> bytes:
    head = b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\n"
    head += b"x-llmflow-reason: " + code + b"\r\n"
    if retry_after is not None:
        head += b"retry-after: " + str(retry_after).encode() + b"\r\n"
    head += b"connection: close\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n"
    return head + body


class GuardProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, bounded.

    It bounds a request's head: one that grows past the limit before it ends is refused
    as soon as it does (httptools would buffer it all), and one that ends over the limit is
    refused before the app sees it; either way with 431 and an OpenAI-style body. After such
    an error the connection reads and drops what the client is still sending for a moment, so
    the client gets to read the answer instead of a reset.

    `read_timeout_s`: how long a client may take to send a request's head and body
    (`server.read_timeout_ms`; set it with `configured`), `write_timeout_s` how long it may take
    nothing of a reply (`server.write_timeout_ms`).
    """

    _head_open = True  # reading a request line and headers
    _head_bytes = 0  # bytes received while the head was open
    _head_too_large = False  # the parser stopped because the head passed the limit
    _discarding = False  # an error was sent: what still arrives is dropped
    _began_in_read = False  # a request began inside the read being parsed
    _pipeline_too_deep = False  # the parser stopped at MAX_PIPELINE queued requests

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
    _write_timer: asyncio.TimerHandle | None = None
    _read_timer: asyncio.TimerHandle | None = None
    _refuse = False
    _begun = False

    @classmethod
    def configured(
        cls, read_timeout_s: float, write_timeout_s: float = 60.0
    ) -> type[GuardProtocol]:
        """This protocol with other read and write timeouts."""
        attributes = {"read_timeout_s": read_timeout_s, "write_timeout_s": write_timeout_s}
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
        super().connection_lost(exc)
        # The protocol's reference cycles (its request cycle, the keep-alive timer's bound
        # method) would keep it for the cyclic GC: a flood's connections
        # closing together then cost one long collection (90 ms measured) in the middle of
        # other clients' requests, instead of being freed one by one here.
        self._unset_keepalive_if_required()
        self.scope = self.cycle = None  # type: ignore[assignment]

    def on_message_begin(self) -> None:
        self._head_open, self._head_bytes, self._began_in_read = True, 0, True
        super().on_message_begin()
        self._begun = True
        self._arm_read_timer()

    def handle_websocket_upgrade(self) -> None:
        self._disarm_read_timer()  # the connection is the WebSocket protocol's from now on
        super().handle_websocket_upgrade()

    def on_message_complete(self) -> None:
        self._disarm_read_timer()
        self._begun = False
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
        cycle = self.cycle
        if self._begun and (cycle is None or not cycle.response_started):
            timed_out = _error_response(b"408 Request Timeout", _TIMED_OUT, b"request_timeout")
            self.transport.write(timed_out)
            if cycle is not None:
                cycle.disconnected = True  # the handler waiting for the body hears it left
        self.transport.close()


class _Lingering:
    """A request cycle's view of the transport: closing with the body unread lingers first.

    An early answer (413 for a body over the limit, a refusal before the body is read) is
    followed by uvicorn closing the connection while the client is still sending; without
    lingering, the client would see a reset instead of the answer.
    """

    def __init__(self, transport: asyncio.Transport, protocol: GuardProtocol, cycle: Any) -> None:
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

