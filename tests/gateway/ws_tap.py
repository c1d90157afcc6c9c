"""A TCP proxy in front of the gateway that reads the WebSocket protocol on the wire.

A browser test points chromium at the tap instead of the gateway: pages, scripts and HTTP calls
pass through untouched, and on a WebSocket connection every frame is parsed both ways, so the
test counts the chunks the gateway sent and the acks the page sent with its own instrument, not
the gateway's counters. The upgrade goes through without `Sec-WebSocket-Extensions` (so no
permessage-deflate: frames stay readable); the gateway then speaks plain frames, as it does to
any client that offers no extension.

The tap sees a chunk after the gateway wrote it and an ack before the gateway reads it, so at
every moment its `sent - acked` is at most the gateway's own: a gateway that overran the window
while the page was slow would show here as soon as the extra chunk crossed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable

__all__ = ["Tap", "WireSocket", "ws_tap"]

_HEAD_END = b"\r\n\r\n"
_TEXT, _CONTINUATION, _CLOSE = 0x1, 0x0, 0x8


@dataclass
class WireSocket:
    """What crossed one WebSocket connection, as JSON messages, counted per request."""

    sent: int = 0  # highest chunk seq the gateway sent (of the current request)
    acked: int = 0  # highest seq the page acknowledged
    peak_unacked: int = 0  # the most `sent - acked` ever was
    request_id: int | None = None  # the gateway's id, from `start`
    chunk_tokens: list[int] = field(default_factory=list)  # completion tokens per chunk
    text: list[str] = field(default_factory=list)  # each chunk's text, in order
    ends: list[dict[str, Any]] = field(default_factory=list)
    closed: bool = False
    upgrade: dict[str, str] = field(default_factory=dict)  # the page's upgrade request headers

    def from_gateway(self, message: dict[str, Any]) -> None:
        kind = message.get("type")
        if kind == "start":
            self.sent = self.acked = 0
            self.request_id = message.get("request_id")
        elif kind == "chunk":
            self.sent = message["seq"]
            data = message["data"]
            used = sum(self.chunk_tokens)
            usage = data.get("usage") or {}
            self.chunk_tokens.append(usage.get("completion_tokens", used) - used)
            self.text.append(
                "".join(
                    (c.get("delta") or {}).get("content") or c.get("text") or ""
                    for c in data.get("choices") or ()
                )
            )
        elif kind == "end":
            self.ends.append(message)
        self.peak_unacked = max(self.peak_unacked, self.sent - self.acked)

    def from_page(self, message: dict[str, Any]) -> None:
        if message.get("type") == "ack":
            self.acked = max(self.acked, int(message["seq"]))


@dataclass
class Tap:
    """The proxy's address and every WebSocket connection it carried."""

    url: str
    sockets: list[WireSocket] = field(default_factory=list)


async def _frames(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, on_text: Callable[[str], None]
) -> None:
    """Forward frames from `reader` to `writer`, handing each whole text message to `on_text`."""
    parts: list[bytes] = []
    while True:
        head = await reader.readexactly(2)
        opcode, masked, length = head[0] & 0x0F, head[1] & 0x80, head[1] & 0x7F
        extra = b""
        if length == 126:
            extra = await reader.readexactly(2)
            (length,) = struct.unpack("!H", extra)
        elif length == 127:
            extra = await reader.readexactly(8)
            (length,) = struct.unpack("!Q", extra)
        mask = await reader.readexactly(4) if masked else b""
        payload = await reader.readexactly(length)
        plain = bytes(b ^ mask[i % 4] for i, b in enumerate(payload)) if mask else payload
        if opcode in (_TEXT, _CONTINUATION) and (opcode == _TEXT or parts):
            parts.append(plain)
            if head[0] & 0x80:  # FIN: the message is whole
                on_text(b"".join(parts).decode())
                parts = []
        writer.write(head + extra + mask + payload)
        await writer.drain()
        if opcode == _CLOSE:
            return


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()


def _headers(head: bytes) -> dict[str, str]:
    lines = head.decode("latin-1").split("\r\n")[1:]
    pairs = (line.split(":", 1) for line in lines if ":" in line)
    return {name.strip().lower(): value.strip() for name, value in pairs}


def _without_extensions(head: bytes) -> bytes:
    lines = head.split(b"\r\n")
    kept = [ln for ln in lines if not ln.lower().startswith(b"sec-websocket-extensions:")]
    return b"\r\n".join(kept)


async def _carry(tap: Tap, target: tuple[str, int], client_r: Any, client_w: Any) -> None:
    up_r, up_w = await asyncio.open_connection(*target)
    tasks: list[asyncio.Task[None]] = []
    wire: WireSocket | None = None
    try:
        head = await client_r.readuntil(_HEAD_END)
        if b"upgrade: websocket" not in head.lower():
            up_w.write(head)
            tasks = [
                asyncio.create_task(_pipe(a, b)) for a, b in ((client_r, up_w), (up_r, client_w))
            ]
        else:
            up_w.write(_without_extensions(head))
            client_w.write(await up_r.readuntil(_HEAD_END))  # the 101 (or the refusal)
            wire = WireSocket(upgrade=_headers(head))
            tap.sockets.append(wire)
            page, gateway = wire.from_page, wire.from_gateway
            tasks = [
                asyncio.create_task(_frames(client_r, up_w, lambda t: page(json.loads(t)))),
                asyncio.create_task(_frames(up_r, client_w, lambda t: gateway(json.loads(t)))),
            ]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
        pass
    finally:
        if wire is not None:
            wire.closed = True
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for w in (up_w, client_w):
            w.close()


@contextlib.asynccontextmanager
async def ws_tap(gateway_url: str) -> AsyncIterator[Tap]:
    """A tap on `127.0.0.1:<ephemeral>` in front of `gateway_url` (`http://127.0.0.1:PORT`)."""
    host, port = gateway_url.removeprefix("http://").split(":")
    connections: set[asyncio.Task[None]] = set()
    tap = Tap("")

    def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.create_task(_carry(tap, (host, int(port)), reader, writer))
        connections.add(task)
        task.add_done_callback(connections.discard)

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    tap.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        yield tap
    finally:
        server.close()
        for task in list(connections):
            task.cancel()
        await asyncio.gather(*connections, return_exceptions=True)
        await server.wait_closed()
