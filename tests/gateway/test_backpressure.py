"""Bounded per-stream window, pausing upstream when full, and the stall timeout."""

from __future__ import annotations

import asyncio
import json
import socket
from typing import TYPE_CHECKING, Any

import pytest

from llmflow.gateway.backpressure import ChunkWindow

from .harness import start_gateway, until

if TYPE_CHECKING:
    from collections.abc import Callable

pytestmark = pytest.mark.anyio


def _chunk(text: str, finish: str | None = None) -> dict[str, Any]:
    return {
        "id": "c",
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}],
    }


async def test_a_full_window_pauses_the_producer_until_the_consumer_takes() -> None:
    window = ChunkWindow(capacity=3, pause_when_full=True)
    produced = 0

    async def producer() -> None:
        nonlocal produced
        for i in range(10):
            await window.put(_chunk(f"{i}"))
            produced += 1
        window.close()

    task = asyncio.create_task(producer())
    await asyncio.sleep(0.01)
    assert (produced, len(window)) == (3, 3)  # stopped reading at the bound
    assert len(await window.take()) == 3
    await asyncio.sleep(0.01)
    assert produced == 6
    taken = []
    while batch := await window.take():
        taken += batch
    await task
    assert window.high_water == 3
    assert window.pauses >= 3
    assert len(taken) == 7


async def test_without_pausing_overflow_merges_into_the_newest_chunk() -> None:
    window = ChunkWindow(capacity=2, pause_when_full=False)
    for i in range(50):
        await window.put(_chunk(f"{i},"))
    assert len(window) == 2  # bounded in chunks however fast the producer
    first, last = window.take_nowait()
    assert first["choices"][0]["delta"]["content"] == "0,"
    assert last["choices"][0]["delta"]["content"] == "".join(f"{i}," for i in range(1, 50))


async def test_without_pausing_an_unmergeable_chunk_still_waits() -> None:
    window = ChunkWindow(capacity=1, pause_when_full=False)
    await window.put(_chunk("a", finish="stop"))  # a finished choice takes no more text
    blocked = asyncio.create_task(window.put(_chunk("b")))
    await asyncio.sleep(0.01)
    assert not blocked.done()
    assert len(await window.take()) == 1
    await blocked
    assert len(window) == 1


async def test_the_final_chunk_passes_the_bound_and_closes() -> None:
    window = ChunkWindow(capacity=1, pause_when_full=True)
    await window.put(_chunk("a"))
    window.put_final(_chunk("notice", finish="length"))
    assert [len(await window.take()), await window.take()] == [2, []]


async def test_the_window_reports_filling_up_and_getting_room_once_each() -> None:
    window = ChunkWindow(capacity=2, pause_when_full=False)
    seen: list[str] = []
    window.on_full = lambda: seen.append("full")
    window.on_drained = lambda: seen.append("drained")
    await window.put(_chunk("a"))
    assert seen == []
    for text in "bcd":  # full at the second chunk; merging keeps it full without a repeat
        await window.put(_chunk(text))
    assert seen == ["full"]
    window.take_nowait()
    assert seen == ["full", "drained"]
    window.take_nowait()  # nothing to take: no second "drained"
    await window.put(_chunk("e"))
    assert seen == ["full", "drained"]


def _raw_request(url: str, body: dict[str, Any]) -> socket.socket:
    """Send a request from a socket with a tiny receive buffer, and never read the reply."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    payload = json.dumps(body).encode()
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: localhost\r\ncontent-type: "
        b"application/json\r\ncontent-length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload
    )
    return sock


async def _settled(read: Callable[[], int], quiet_s: float = 0.25, timeout_s: float = 5.0) -> int:
    """The value once it has not changed for `quiet_s` (fails after `timeout_s`)."""
    loop = asyncio.get_running_loop()
    deadline, last = loop.time() + timeout_s, read()
    while loop.time() < deadline:
        await asyncio.sleep(quiet_s)
        now = read()
        if now == last:
            return now
        last = now
    raise AssertionError(f"still changing after {timeout_s} s: {last}")


BIG = {
    "model": "fake-model",
    "messages": [{"role": "user", "content": "hi"}],
    "stream": True,
    "max_tokens": 3000,
    "fake": {"chunk_bytes": 16384},
}  # ~48 MB if nothing pushed back


async def test_a_client_that_stops_reading_pauses_upstream_then_is_aborted() -> None:
    async with start_gateway(backpressure={"client_window": 4, "stall_timeout_ms": 800}) as h:
        sock = _raw_request(h.url, BIG)
        try:
            await until(lambda: h.fake.running != 0)
            # buffers fill; the window fills; the reader pauses: the count stops moving (a
            # loaded machine may take longer than a fixed sleep to get there)
            sent = await _settled(lambda: h.fake.tokens_sent)
            assert sent < 1000  # upstream held back: kernel buffers, not 48 MB
            await asyncio.sleep(0.2)
            assert h.fake.tokens_sent == sent  # paused: the backend sends nothing more
            assert h.fake.aborted == 0  # not yet: the stall timer runs
            await until(lambda: h.fake.aborted == 1, timeout_s=3)
            assert h.fake.tokens_sent < 1000
            await until(lambda: h.gateway.metrics.outcomes["cancelled", "client_stall"] == 1)
        finally:
            sock.close()


async def test_without_pausing_upstream_runs_to_the_end_while_the_client_stalls() -> None:
    small = {**BIG, "max_tokens": 400, "fake": {"chunk_bytes": 2048}}
    async with start_gateway(
        backpressure={"client_window": 4, "stall_timeout_ms": 400, "pause_when_full": False}
    ) as h:
        sock = _raw_request(h.url, small)
        try:
            await until(lambda: h.fake.completed == 1)  # drained: its slot frees early
            assert h.fake.aborted == 0
            await h.settle()
            assert h.gateway.runtime.running == 0
        finally:
            sock.close()
