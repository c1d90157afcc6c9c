"""Raw-socket keep-alive clients that time every chunk.

Each stream is one keep-alive connection (as the `openai` client keeps its own) running
streamed requests back to back (closed loop). The per-chunk work happens in
`data_received`: count the SSE `data:` events in the bytes, note the time since the previous
one (the inter-chunk gap) and, for the request's first event, the TTFT. No HTTP library sits
in the way, so a client costs the same whichever server answers it.

A read that carries k events counts as one gap (since the previous read) and k-1 gaps of zero:
chunks that TCP coalesced did arrive together.

Two ways to start the streams: *staggered* (`run_streams`: evenly over one request period, so
arrivals are spread as in steady traffic) and *burst* (`run_burst`: every connection opened
first, then every stream's request written in one loop, so they arrive together; then each
goes on closed-loop, and since every request takes the same time the later requests stay
bunched in waves).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

from benchmarks.gatewaybench.backend import MODEL, plan_text

if TYPE_CHECKING:
    from collections.abc import Callable

_DATA, _DONE, _END = b"data: ", b"data: [DONE]", b"0\r\n\r\n"


@dataclass
class Tally:
    """What the clients saw while `measuring` was on (one arm of one phase)."""

    measuring: bool = False
    ttfts: list[float] = field(default_factory=list)  # seconds, requests sent while measuring
    burst_ttfts: list[float] = field(default_factory=list)  # seconds, a measured burst's requests
    gaps: list[float] = field(default_factory=list)  # seconds, non-zero inter-chunk gaps
    zero_gaps: int = 0  # chunks that came in the same read as the one before
    chunks: int = 0  # token events received while measuring ([DONE] not counted)
    requests: int = 0  # requests completed while measuring
    statuses: dict[int, int] = field(default_factory=dict)  # non-200 answers, by status
    errors: int = 0  # connections that failed or closed mid-response

    @property
    def refused(self) -> int:
        """Requests not served: non-200 answers and broken connections."""
        return sum(self.statuses.values()) + self.errors


def request_bytes(port: int, tokens: int, ttft_ms: float, itl_ms: float, hold: bool) -> bytes:
    """One streamed chat completion as raw HTTP/1.1."""
    body = json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": plan_text(ttft_ms, itl_ms, hold)}],
            "max_tokens": tokens,
            "stream": True,
        }
    ).encode()
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:%d\r\n"
        b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % (port, len(body))
    ) + body


class ClientConn(asyncio.Protocol):
    """One keep-alive connection; `request` sends one streamed request and times its chunks."""

    def __init__(self, tally: Tally) -> None:
        self.tally = tally
        self.transport: asyncio.Transport | None = None
        self.closed = asyncio.get_running_loop().create_future()
        self.done: asyncio.Future[bool] | None = None  # True: served to the end (or first token)
        self.until_first = False
        self.status = 0
        self.sent_at = self.last_at = 0.0
        self.timed = False  # sent while measuring: its TTFT counts
        self.first = False
        self.finished = False
        self.in_burst = False  # the request in flight is a measured burst's: keep its TTFT
        self.tail = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast("asyncio.Transport", transport)  # uvloop's is no subclass

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.done is not None and not self.done.done():
            if self.status in (0, 200):
                self.tally.errors += 1
            self.done.set_result(False)
        if not self.closed.done():
            self.closed.set_result(None)

    def request(self, payload: bytes, until_first: bool = False) -> asyncio.Future[bool]:
        """Send one request; the future is True once it ended well (or, `until_first`, once the
        first token came), False if it was refused or the connection broke."""
        assert self.transport is not None
        self.done = asyncio.get_running_loop().create_future()
        self.until_first, self.status, self.tail = until_first, 0, b""
        self.first = self.finished = False
        self.timed = self.tally.measuring
        self.sent_at = time.perf_counter()
        self.transport.write(payload)
        return self.done

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        tally, window = self.tally, self.tail + data
        if not self.status:
            self.status = int(window[9:12]) if window.startswith(b"HTTP/1.1 ") else 599
            if self.status != 200:
                tally.statuses[self.status] = tally.statuses.get(self.status, 0) + 1
                assert self.transport is not None
                self.transport.close()  # the next request reconnects
                return
        events = window.count(_DATA) - self.tail.count(_DATA)
        if _DONE in window and not self.finished:
            self.finished = True
            events -= 1
        if events > 0:
            self._chunks(events, now)
        self.tail = window[-16:]
        if self.finished and window.endswith(_END):
            tally.requests += tally.measuring
            self._resolve(True)

    def _chunks(self, events: int, now: float) -> None:
        tally = self.tally
        if not self.first:
            self.first = True
            if self.timed:
                tally.ttfts.append(now - self.sent_at)
            if self.in_burst:
                self.in_burst = False
                tally.burst_ttfts.append(now - self.sent_at)
            if self.until_first:
                self._resolve(True)
        elif tally.measuring:
            tally.gaps.append(now - self.last_at)
        if tally.measuring:
            tally.chunks += events
            tally.zero_gaps += events - 1
        self.last_at = now

    def _resolve(self, ok: bool) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_result(ok)

    def close(self) -> None:
        """Drop the connection (mid-response too: the server sees the client go)."""
        if self.transport is not None:
            self.transport.close()


async def connect(port: int, tally: Tally) -> ClientConn:
    """Open one client connection to 127.0.0.1:`port`."""
    loop = asyncio.get_running_loop()
    _, conn = await loop.create_connection(lambda: ClientConn(tally), "127.0.0.1", port)
    return conn


async def closed_loop(
    port: int, tally: Tally, payload: bytes, delay: float, stop: asyncio.Event
) -> None:
    """One stream: after `delay`, requests back to back on one connection until `stop`."""
    await asyncio.sleep(delay)
    conn: ClientConn | None = None
    try:
        while not stop.is_set():
            if conn is None or conn.transport is None:
                conn = await connect(port, tally)
            await conn.request(payload)
    finally:
        if conn is not None:
            conn.close()


async def run_streams(
    port: int,
    streams: int,
    payload: bytes,
    period: float,
    warmup: float,
    window: float,
    on_window: tuple[Callable[[], None], Callable[[], None]] | None = None,
) -> Tally:
    """`streams` closed-loop streams, started evenly over one request `period` (no
    synchronised burst), measured for `window` seconds after `warmup`.

    `on_window` = (start, end) callables run as the window opens and closes (the gateway's
    CPU reading). Requests sent in the window may finish up to 1 s after it for their TTFT.
    """
    tally, stop = Tally(), asyncio.Event()
    tasks = [
        asyncio.create_task(closed_loop(port, tally, payload, period * i / streams, stop))
        for i in range(streams)
    ]
    try:
        await asyncio.sleep(max(warmup, period))
        if on_window:
            on_window[0]()
        tally.measuring = True
        await asyncio.sleep(window)
        tally.measuring = False
        if on_window:
            on_window[1]()
        await asyncio.sleep(min(1.0, period))
    finally:
        stop.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return tally


@dataclass
class Burst:
    """How a burst's requests went out."""

    connect_s: float  # opening every connection (before the burst; not measured)
    write_ms: float  # from the first stream's request write to the last one's


async def run_burst(
    port: int,
    streams: int,
    payload: bytes,
    settle: float,
    window: float,
    on_window: tuple[Callable[[], None], Callable[[], None]] | None = None,
) -> tuple[Tally, Burst]:
    """`streams` closed-loop streams that start together, measured for `window` seconds from
    the burst.

    Every connection is opened first (at most 256 at once, then `settle` seconds so that the
    server has accepted them all). One unmeasured burst of requests on them, run to its end,
    warms the gateway (its connections to the backend, its state per client connection), so
    that the figure is the same whether or not the gateway served traffic before. After
    `settle` seconds more the window opens and one loop writes every stream's request, with
    nothing awaited between the writes; then each stream goes on closed loop on its connection
    as in `run_streams`. The burst's own TTFTs are also kept apart (`Tally.burst_ttfts`).
    """
    tally, stop = Tally(), asyncio.Event()
    began = time.perf_counter()
    conns = await open_conns(port, streams, tally)
    connect_s = time.perf_counter() - began
    tasks: list[asyncio.Task[None]] = []
    try:
        await asyncio.sleep(settle)
        conns = await _reopened(port, tally, conns)
        if conns:
            await asyncio.wait([conn.request(payload) for conn in conns], timeout=30)
        await asyncio.sleep(settle)
        conns = await _reopened(port, tally, conns)
        if on_window:
            on_window[0]()
        tally.measuring = True
        for conn in conns:
            conn.in_burst = True
        sent = [conn.request(payload) for conn in conns]  # the burst: one tight loop
        write_ms = (conns[-1].sent_at - conns[0].sent_at) * 1e3 if conns else 0.0
        tasks = [
            asyncio.create_task(_after_burst(port, tally, payload, conn, request, stop))
            for conn, request in zip(conns, sent, strict=True)
        ]
        await asyncio.sleep(window)
        tally.measuring = False
        if on_window:
            on_window[1]()
        await asyncio.sleep(1.0)
    finally:
        stop.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for conn in conns:
            conn.close()
    return tally, Burst(round(connect_s, 3), round(write_ms, 3))


async def _reopened(port: int, tally: Tally, conns: list[ClientConn]) -> list[ClientConn]:
    """`conns`, with any that closed (a refusal closes it) replaced by a new connection."""
    return [c if c.transport is not None else await connect(port, tally) for c in conns]


async def _after_burst(
    port: int,
    tally: Tally,
    payload: bytes,
    conn: ClientConn,
    request: asyncio.Future[bool],
    stop: asyncio.Event,
) -> None:
    """A burst's stream once its `request` is out: closed loop until `stop`."""
    try:
        await request
        while not stop.is_set():
            if conn.transport is None:
                conn = await connect(port, tally)
            await conn.request(payload)
    finally:
        conn.close()


async def open_conns(port: int, k: int, tally: Tally, parallel: int = 256) -> list[ClientConn]:
    """`k` connections, at most `parallel` opening at once (the listen backlog never overflows);
    a connection that fails counts as an error in `tally` and is left out."""
    gate = asyncio.Semaphore(parallel)

    async def one() -> ClientConn | None:
        async with gate:
            try:
                return await connect(port, tally)
            except OSError:
                tally.errors += 1
                return None

    return [c for c in await asyncio.gather(*(one() for _ in range(k))) if c is not None]


async def hold_open(
    port: int, k: int, payload: bytes, parallel: int = 256
) -> tuple[list[ClientConn], Tally]:
    """Open `k` streams that each wait for their first token; returns the open connections.

    At most `parallel` are opening at once, so the listen backlog never overflows.
    """
    tally, gate = Tally(measuring=True), asyncio.Semaphore(parallel)
    conns: list[ClientConn] = []

    async def one() -> None:
        async with gate:
            try:
                conn = await connect(port, tally)
            except OSError:
                tally.errors += 1
                return
            conns.append(conn)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(conn.request(payload, until_first=True), 60)

    await asyncio.gather(*(one() for _ in range(k)))
    return conns, tally


async def close_all(conns: list[ClientConn]) -> None:
    """Close every connection and wait (briefly) until they are gone."""
    for conn in conns:
        conn.close()
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(asyncio.gather(*(c.closed for c in conns)), 10)


def percentile(values: list[float], q: float, zeros: int = 0) -> float | None:
    """Nearest-rank percentile `q` (0-100) of `values` (s) plus `zeros` zeros, in ms."""
    n = len(values) + zeros
    if n == 0:
        return None
    rank = min(n - 1, max(0, round(q / 100 * (n - 1))))
    if rank < zeros:
        return 0.0
    return sorted(values)[rank - zeros] * 1e3
