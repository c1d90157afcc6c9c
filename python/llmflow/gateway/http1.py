"""A minimal HTTP/1.1 client for the per-chunk hot path: streamed POSTs to vLLM over keep-alive.

httpx parses every HTTP chunk through h11 (about 40 us per SSE event on this machine), which alone
would spend most of the gateway's per-chunk budget. This client reads whatever bytes the socket
has (many events per read under load) and decodes chunked transfer encoding in bulk. It speaks
only what vLLM's server (uvicorn) sends: a status line, headers, and a body that is chunked,
sized by `Content-Length`, or delimited by the connection closing.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import ssl
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable

__all__ = [
    "Connection",
    "ConnectionLost",
    "ConnectionPool",
    "HttpResponse",
    "Origin",
    "ProtocolError",
    "StaleConnection",
    "chunk_size",
    "content_length",
    "origin",
]

_READ_SIZE = 65536  # bytes per socket read
_HEAD_LIMIT = 64 * 1024  # the most bytes of status line and headers accepted
_SIZE_LINE_LIMIT = 1024  # a chunk's size line (hex digits and extensions)
_HEX = frozenset(b"0123456789abcdefABCDEF")


Origin = tuple[str, str, int]  # (scheme, host, port): what a connection is pooled by


def origin(url: str) -> Origin:
    """The (scheme, host, port) of `url`, its scheme's port when it names none."""
    parts = urlsplit(url)
    return (
        parts.scheme,
        parts.hostname or "127.0.0.1",
        parts.port or (443 if parts.scheme == "https" else 80),
    )


class ProtocolError(Exception):
    """The backend broke the HTTP exchange (bad framing, or closed mid-response)."""


class ConnectionLost(ProtocolError):
    """The backend's connection closed in the middle of a response (a killed process)."""


class StaleConnection(ConnectionLost):
    """A pooled connection closed before a byte of the response came (an idle keep-alive
    the backend had closed, or a backend that died with the request)."""


class Connection:
    """One TCP (or TLS) connection to a backend."""

    def __init__(
        self, key: Origin, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.key, self.reader, self.writer = key, reader, writer

    def usable(self) -> bool:
        """True while the peer has not closed it."""
        return not self.reader.at_eof() and not self.writer.is_closing()

    def close(self) -> None:
        """Close now; an unfinished response is abandoned (the server sees a disconnect)."""
        self.writer.close()

    def shut_down_now(self) -> None:
        """Shut the socket down at once, not on the loop's next turn as `close` does: the
        server sees the disconnect before this loop sends anything else (an abort reaches
        vLLM before a request started in the slot it freed)."""
        sock = self.writer.get_extra_info("socket")
        if sock is None:
            return
        with contextlib.suppress(OSError), socket.socket(fileno=os.dup(sock.fileno())) as dup:
            dup.shutdown(socket.SHUT_RDWR)


class HttpResponse:
    """Status, headers, and a body read incrementally from a `Connection`."""

    def __init__(
        self, pool: ConnectionPool, conn: Connection, status: int, headers: dict[str, str]
    ) -> None:
        self.pool, self.conn, self.status, self.headers = pool, conn, status, headers
        self.complete = False
        self._released = False

    async def iter_body(self) -> AsyncIterator[bytes]:
        """The body as it arrives, de-chunked; many upstream writes per piece under load.

        Raises:
            ProtocolError: the connection closed early or the framing is invalid.
        """
        reader = self.conn.reader
        if "chunked" in self.headers.get("transfer-encoding", ""):
            async for piece in _dechunk(reader):
                yield piece
        elif "content-length" in self.headers:
            left = content_length(self.headers["content-length"])
            while left > 0:
                piece = await reader.read(min(left, _READ_SIZE))
                if not piece:
                    raise ConnectionLost("connection closed before the body ended")
                left -= len(piece)
                yield piece
        else:
            while piece := await reader.read(_READ_SIZE):
                yield piece
            self.headers["connection"] = "close"
        self.complete = True

    async def read_all(self, limit: int) -> bytes:
        """Up to `limit` bytes of the body (the rest is dropped with the connection)."""
        out = b""
        with contextlib.suppress(ProtocolError, ConnectionError):
            async for piece in self.iter_body():
                out += piece
                if len(out) >= limit:
                    break
        return out

    def release(self) -> None:
        """Give the connection back: pooled if the body was read to its end, else closed."""
        if self._released:
            return
        self._released = True
        reusable = self.complete and self.headers.get("connection", "").lower() != "close"
        if reusable and self.conn.usable():
            self.pool.put(self.conn)
        else:
            self.conn.close()


def content_length(value: str) -> int:
    """A `Content-Length` value: decimal digits only (no sign, space or list).

    Raises:
        ProtocolError: anything else (`-5`, `+5`, `5, 6`), which would desynchronise the
            connection for the next response.
    """
    if not value or len(value) > 18 or not all("0" <= c <= "9" for c in value):
        raise ProtocolError(f"bad Content-Length {value[:40]!r}")
    return int(value)


async def _dechunk(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    buffer, left, state = b"", 0, "size"  # state: size line, chunk data, or its trailing CRLF
    while True:
        out: list[bytes] = []
        while True:
            if state == "size":
                end = buffer.find(b"\r\n")
                if end < 0:
                    if len(buffer) > _SIZE_LINE_LIMIT:
                        raise ProtocolError("chunk size line without end")
                    break
                left = chunk_size(buffer[:end])
                buffer, state = buffer[end + 2 :], "data"
                if left == 0:
                    if out:
                        yield b"".join(out)
                    await _skip_trailers(reader, buffer)
                    return
            elif state == "data":
                piece = buffer[:left]
                if piece:
                    out.append(piece)
                    left -= len(piece)
                    buffer = buffer[len(piece) :]
                if left:
                    break
                state = "crlf"
            else:
                if len(buffer) < 2:
                    break
                if buffer[:2] != b"\r\n":
                    raise ProtocolError("chunk data not followed by CRLF")
                buffer, state = buffer[2:], "size"
        if out:
            yield b"".join(out)
        more = await reader.read(_READ_SIZE)
        if not more:
            raise ConnectionLost("connection closed inside the chunked body")
        buffer += more


def chunk_size(line: bytes) -> int:
    """A chunk's size from its line: hex digits, then optional `;` extensions.

    Raises:
        ProtocolError: anything else (`int(x, 16)` alone takes `-5`, `+5`, `0x5`, `5_0`, and
            spaces), or more than 16 digits.
    """
    digits = line.split(b";", 1)[0].rstrip(b" \t")
    if not digits or len(digits) > 16 or not _HEX.issuperset(digits):
        raise ProtocolError(f"bad chunk size line {line[:40]!r}")
    return int(digits, 16)


async def _skip_trailers(reader: asyncio.StreamReader, buffer: bytes) -> None:
    while not (buffer.startswith(b"\r\n") or b"\r\n\r\n" in buffer):
        if len(buffer) > _HEAD_LIMIT:
            raise ProtocolError("trailers without end")
        more = await reader.read(_READ_SIZE)
        if not more:
            return
        buffer += more


class ConnectionPool:
    """Keep-alive connections per backend origin.

    Args:
        connect_timeout_s: how long opening a connection may take (the TLS handshake too).
        tls: how an https origin's certificate is verified (its own CA); any other https
            origin gets `default_tls()`, made at its first connection.
    """

    def __init__(
        self,
        connect_timeout_s: float,
        tls: dict[Origin, ssl.SSLContext] | None = None,
        default_tls: Callable[[], ssl.SSLContext] = ssl.create_default_context,
    ) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.tls = dict(tls or {})
        self.default_tls = default_tls
        self._idle: dict[Origin, list[Connection]] = {}

    def put(self, conn: Connection) -> None:
        """Keep an idle connection for reuse."""
        self._idle.setdefault(conn.key, []).append(conn)

    async def request(
        self,
        url: str,
        head: bytes,
        body: bytes,
        on_connection: Callable[[Connection], None] | None = None,
    ) -> HttpResponse:
        """Send one request and read its status line and headers.

        Args:
            url: the full URL (`http://host:port/path` or `https://...`).
            head: the header lines after the request line, each ending in CRLF, no Host.
            body: the request body (its Content-Length is added).
            on_connection: told each connection the request goes out on, before it is sent
                (so an abort can shut it down while the head is awaited).

        Raises:
            OSError, TimeoutError: the connection could not be opened.
            ProtocolError: the backend closed or sent garbage before the headers ended.
        """
        parts = urlsplit(url)
        key = origin(url)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        message = (
            (
                f"POST {target} HTTP/1.1\r\nhost: {parts.netloc}\r\ncontent-length: {len(body)}\r\n"
            ).encode("latin-1")
            + head
            + b"\r\n"
            + body
        )
        while idle := self._idle.get(key):
            conn = idle.pop()
            if not conn.usable():
                conn.close()
                continue
            if on_connection is not None:
                on_connection(conn)
            try:
                return await self._exchange(conn, message, pooled=True)
            except StaleConnection:
                # A POST is not idempotent: it goes out again once, on a fresh connection,
                # and only when not a byte of an answer came. The other idle connections
                # date from the same backend life; they go too.
                conn.close()
                self._drop_idle(key)
                break
        conn = await self._open(key)
        if on_connection is not None:
            on_connection(conn)
        return await self._exchange(conn, message)

    async def _open(self, key: Origin) -> Connection:
        context = None
        if key[0] == "https":
            if key not in self.tls:
                self.tls[key] = self.default_tls()
            context = self.tls[key]
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(key[1], key[2], ssl=context, limit=_HEAD_LIMIT),
            self.connect_timeout_s,
        )
        return Connection(key, reader, writer)

    def _drop_idle(self, key: Origin) -> None:
        for conn in self._idle.pop(key, ()):
            conn.close()

    async def _exchange(
        self, conn: Connection, message: bytes, pooled: bool = False
    ) -> HttpResponse:
        """Send `message` on `conn` and read the response head.

        Raises:
            StaleConnection: `pooled`, and the connection closed before a byte came back.
        """
        try:
            conn.writer.write(message)
            head = await conn.reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as exc:
            conn.close()
            if pooled and not exc.partial:
                raise StaleConnection("connection closed before the response") from None
            # worded as the relay words it
            raise ProtocolError("no response head: the backend closed the connection") from None
        except asyncio.LimitOverrunError as exc:
            conn.close()
            raise ProtocolError(f"no response head: {exc!r}") from None
        except ConnectionError as exc:
            conn.close()
            if pooled:
                raise StaleConnection(f"connection failed before the response: {exc!r}") from None
            raise
        except BaseException:
            conn.close()
            raise
        lines = head.decode("latin-1").split("\r\n")
        try:
            status = int(lines[0].split(" ", 2)[1])
        except (IndexError, ValueError):
            conn.close()
            raise ProtocolError(f"bad status line {lines[0][:80]!r}") from None
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                name, value = name.strip().lower(), value.strip()
                if name in headers and name == "content-length" and headers[name] != value:
                    conn.close()  # two lengths: which one frames the body is anyone's guess
                    raise ProtocolError("response with two different Content-Length values")
                headers[name] = value
        if "transfer-encoding" in headers and "content-length" in headers:
            headers["connection"] = "close"  # chunked wins (RFC 9112); never reuse such a link
        if "content-length" in headers and "chunked" not in headers.get("transfer-encoding", ""):
            try:
                content_length(headers["content-length"])
            except ProtocolError:
                conn.close()
                raise
        return HttpResponse(self, conn, status, headers)

    def close(self) -> None:
        """Close every idle connection."""
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()
