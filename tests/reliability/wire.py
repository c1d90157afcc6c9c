"""Raw HTTP/1.1 on a socket, for hostile inputs no well-behaved client library would send.

What a test asserts is read from these bytes: the status line, the body, when the peer closed.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

__all__ = ["exchange", "fds_of_self", "open_raw", "post_bytes", "read_until_closed", "rss_bytes"]


async def open_raw(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A plain TCP connection to `http://host:port`."""
    host, port = url.removeprefix("http://").split(":")
    return await asyncio.open_connection(host, int(port))


def post_bytes(path: str, body: dict[str, Any] | bytes, headers: str = "") -> bytes:
    """A POST with a Content-Length body (`headers`: extra lines, each ending in CRLF)."""
    payload = body if isinstance(body, bytes) else json.dumps(body).encode()
    return (
        f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        f"{headers}content-length: {len(payload)}\r\n\r\n"
    ).encode() + payload


async def read_until_closed(reader: asyncio.StreamReader, timeout_s: float = 5.0) -> bytes:
    """Everything the peer sends until it closes (or `timeout_s` passes: then what came)."""
    out = b""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while (left := deadline - loop.time()) > 0:
        try:
            data = await asyncio.wait_for(reader.read(65536), left)
        except TimeoutError:
            break
        if not data:
            break
        out += data
    return out


async def exchange(url: str, raw: bytes, timeout_s: float = 5.0) -> bytes:
    """Send `raw` on a fresh connection, half-close nothing, and read until the peer closes."""
    reader, writer = await open_raw(url)
    try:
        writer.write(raw)
        await writer.drain()
        return await read_until_closed(reader, timeout_s)
    finally:
        writer.close()


def rss_bytes(pid: int | None = None) -> int:
    """Resident set size from /proc (this process by default)."""
    with open(f"/proc/{pid or os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def fds_of_self() -> int:
    """Open file descriptors of this process, counted in /proc."""
    return len(os.listdir("/proc/self/fd"))
