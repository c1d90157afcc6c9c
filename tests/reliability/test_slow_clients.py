"""Slow clients: one that reads a byte a second, one that never reads, slowloris requests.

A reader too slow for its stream fills its window; the runtime's stall timer cuts it and the
upstream request is aborted (the fake counts it), while the backend, held back by the window,
sent only a bounded number of tokens: memory stays bounded. A client that trickles its
request's head or body is answered 408 and closed at `server.read_timeout_ms`, holding no
slot meanwhile, and the gateway serves everyone else throughout.
"""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import pytest

from tests.gateway.harness import start_gateway, until

from .replies import CHAT, chat
from .zero import assert_back_to_zero, fakes_running

pytestmark = pytest.mark.anyio

STALL_MS = 800
LONG: dict[str, Any] = chat(max_tokens=3000, fake={"chunk_bytes": 16384})  # ~48 MB if unread


def _connect(url: str, rcvbuf: int = 4096) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect((host, int(port)))
    sock.setblocking(False)
    return sock


def _request(body: dict[str, Any]) -> bytes:
    payload = json.dumps(body).encode()
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\n"
        b"host: localhost\r\ncontent-type: application/json\r\n"
        b"content-length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload
    )


async def _read_slowly(sock: socket.socket, per_second: int, seconds: float) -> bytes:
    """Read `per_second` bytes each second (0: never read) for `seconds` or until closed."""
    loop = asyncio.get_running_loop()
    got = b""
    for _ in range(int(seconds)):
        await asyncio.sleep(1.0)
        if per_second:
            try:
                piece = await asyncio.wait_for(loop.sock_recv(sock, per_second), 0.05)
            except (TimeoutError, asyncio.TimeoutError):
                continue
            except OSError:
                break
            if not piece:
                break
            got += piece
    return got


@pytest.mark.parametrize("per_second", [1, 0], ids=["byte_a_second", "never_reads"])
async def test_a_client_too_slow_for_its_stream_is_cut_and_its_slot_freed(
    per_second: int,
) -> None:
    async with start_gateway(
        backpressure={"client_window": 4, "stall_timeout_ms": STALL_MS},
    ) as h:
        socks = [_connect(h.url) for _ in range(3)]
        try:
            for sock in socks:
                sock.sendall(_request(LONG))
            readers = [_read_slowly(s, per_second, 4) for s in socks]
            reading = asyncio.gather(*readers)
            await until(lambda: h.fake.aborted == len(socks), timeout_s=10)
            # Held back by the window: what the fake sent sits in kernel buffers (loopback
            # autotunes them to megabytes), a third of each reply at most, not 48 MB each.
            assert h.fake.tokens_sent < len(socks) * 1000
            await assert_back_to_zero(h.url, fakes_running(h.fakes.values()))
            await reading
            outcomes = (await h.client.get("/api/state")).json()["outcomes"]
            assert {"outcome": "cancelled", "reason": "client_stall", "count": 3} in outcomes
            r = await h.client.post(CHAT, json=chat(stream=False, max_tokens=2))
            assert r.status_code == 200  # everyone else is served
        finally:
            for sock in socks:
                sock.close()


@pytest.mark.parametrize("stage", ["head", "body", "nothing"])
async def test_slowloris_requests_get_408_and_are_closed_at_the_read_timeout(stage: str) -> None:
    n = 20
    async with start_gateway(server={"read_timeout_ms": 1000}) as h:
        request = _request(chat(stream=False, max_tokens=2))
        split = {"head": 20, "body": request.index(b"\r\n\r\n") + 10, "nothing": 0}[stage]
        socks = [_connect(h.url, rcvbuf=65536) for _ in range(n)]
        loop = asyncio.get_running_loop()
        try:
            for sock in socks:
                await loop.sock_sendall(sock, request[:split])

            async def trickle(sock: socket.socket) -> bytes:
                reply = b""
                for i in range(split, len(request)):  # a byte every 0.2 s, for ever
                    try:
                        piece: bytes | None = sock.recv(4096)
                    except BlockingIOError:
                        piece = None
                    except OSError:
                        return reply
                    if piece == b"":  # closed by the gateway
                        return reply
                    reply += piece or b""
                    try:
                        if stage != "nothing":
                            sock.send(request[i : i + 1])
                    except OSError:
                        return reply
                    await asyncio.sleep(0.2)
                return reply

            trickling = asyncio.gather(*(trickle(s) for s in socks))
            await asyncio.sleep(0.3)
            assert (await h.client.get("/api/state")).json()["core"]["running"] == 0
            r = await h.client.post(CHAT, json=chat(stream=False, max_tokens=2))
            assert r.status_code == 200  # served while the slowloris clients trickle
            replies = await asyncio.wait_for(trickling, timeout=10)
            for reply in replies:
                if stage == "nothing":
                    assert reply == b""  # a silent connection is closed silently
                else:
                    assert reply.startswith(b"HTTP/1.1 408 "), reply
                    assert b'"code":"request_timeout"' in reply
            assert h.fake.seen == 1
            await assert_back_to_zero(h.url, fakes_running(h.fakes.values()))
        finally:
            for sock in socks:
                sock.close()
