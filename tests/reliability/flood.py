"""The flood's client: raw keep-alive connections, each sending one request and timing its
answer from the write to the last byte of the body. Shared by `test_flood.py` and
`benchmarks/flood_floor.py`, so the test's figures and the benchmark's peer are measured by
the same instrument."""

from __future__ import annotations

import asyncio
import json
import time

__all__ = ["Conn", "burst", "chat_request", "open_conns", "percentile"]


def chat_request(key: str, model: str, *, stream: bool = False) -> bytes:
    """A small chat completion (8 tokens, streamed or not) as raw HTTP/1.1 bytes."""
    body = json.dumps(
        {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        | ({"stream": True} if stream else {})
    ).encode()
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\n"
        b"host: localhost\r\ncontent-type: application/json\r\n"
        b"authorization: Bearer " + key.encode() + b"\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )


class Conn:
    """One raw client connection: send a request, read one response."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    async def ask(self, request: bytes) -> tuple[int, float]:
        """Send `request`; its status and the seconds until its body was read."""
        start = time.perf_counter()
        self.writer.write(request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        await self.reader.readexactly(length)
        return status, time.perf_counter() - start


async def open_conns(port: int, n: int) -> list[Conn]:
    """`n` connections to 127.0.0.1:`port`, opened in batches (the listen backlog is finite)."""
    conns: list[Conn] = []
    for start in range(0, n, 500):
        pairs = await asyncio.gather(
            *(asyncio.open_connection("127.0.0.1", port) for _ in range(min(500, n - start)))
        )
        conns += [Conn(r, w) for r, w in pairs]
    return conns


async def burst(conns: list[Conn], request: bytes, per_s: float | None) -> list[tuple[int, float]]:
    """One request on each connection: all at once (`per_s` None) or paced at `per_s`."""

    async def one(i: int, conn: Conn) -> tuple[int, float]:
        if per_s:
            await asyncio.sleep(i / per_s)
        return await conn.ask(request)

    return await asyncio.gather(*(one(i, c) for i, c in enumerate(conns)))


def percentile(values: list[float], q: float) -> float:
    """The `q` quantile of `values` (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
