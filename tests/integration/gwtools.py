"""Helpers for the gateway-to-real-vLLM tests: prompts, polling, streaming clients, idleness.

Prompts are random token-id lists (vLLM's prefix cache never hits, and the gateway counts their
length exactly). Every request sets `ignore_eos`, so it runs to `max_tokens`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx

from tests.integration.gateway_server import GatewayProcess

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from pathlib import Path

    from tests.integration.vllm_server import VllmServer

__all__ = [
    "GatewayPool",
    "StreamLog",
    "body",
    "cancel",
    "flood",
    "gateway_idle",
    "poll",
    "prompt_ids",
    "stream_into",
    "wait_vllm_idle",
]

_rng = random.Random()  # fresh prompts: vLLM's prefix cache never hits


def prompt_ids(n: int) -> list[int]:
    """A fresh random prompt of `n` token ids."""
    return [_rng.randrange(100, 4000) for _ in range(n)]


def body(prompt_tokens: int, max_tokens: int, *, stream: bool = True) -> dict[str, Any]:
    """A `/v1/completions` body for the tiny model."""
    out: dict[str, Any] = {"model": "tiny", "prompt": prompt_ids(prompt_tokens),
                           "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}
    if stream:
        out["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return out


def poll(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.02) -> float:
    """Call `predicate` until it is true; return the seconds it took, or raise AssertionError."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"condition not reached within {timeout_s} s")
        time.sleep(interval_s)
    return time.monotonic() - start


def wait_vllm_idle(server: VllmServer, timeout_s: float = 20.0) -> None:
    """Wait until vLLM runs and queues nothing (earlier tests' requests are gone)."""
    with httpx.Client(timeout=5.0) as client:
        def idle() -> bool:
            m = server.metrics(client)
            return m["vllm:num_requests_running"] + m["vllm:num_requests_waiting"] == 0
        poll(idle, timeout_s, 0.05)


def gateway_idle(state: dict[str, Any]) -> bool:
    """Nothing in flight, queued, holding KV blocks or streaming in the gateway."""
    core = state["core"]
    return (core["running"] == 0 and core["queued"] == 0 and core["kv_blocks_in_use"] == 0
            and not state["streams"])


class GatewayPool:
    """Starts gateways for one test and stops them all at its end."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.started: list[GatewayProcess] = []

    def start(self, config: dict[str, Any], *extra_args: str) -> GatewayProcess:
        """Start a gateway with `config` (and more `llmflow serve` arguments) until ready."""
        gw = GatewayProcess(config, self.workdir, extra_args=extra_args).start()
        self.started.append(gw)
        return gw

    def stop(self) -> None:
        """Stop every gateway started here."""
        for gw in reversed(self.started):
            gw.stop()

    @classmethod
    @contextlib.contextmanager
    def running(cls, workdir: Path) -> Iterator[GatewayPool]:
        """A pool whose gateways stop when the block ends."""
        pool = cls(workdir)
        try:
            yield pool
        finally:
            pool.stop()


@dataclass
class StreamLog:
    """What a streaming client saw: status, chunk times, tokens, text, the final chunk."""

    status: int = 0
    sent: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    tokens: int = 0
    text: str = ""
    last: dict[str, Any] | None = None
    headers: dict[str, str] = field(default_factory=dict)
    error: dict[str, Any] | None = None
    done: float = 0.0

    @property
    def first_token(self) -> float:
        """Monotonic time of the first chunk with a choice (inf when none came)."""
        return self.chunk_times[0] if self.chunk_times else float("inf")


async def stream_into(
    client: httpx.AsyncClient, url: str, payload: dict[str, Any], log: StreamLog,
    headers: dict[str, str] | None = None,
) -> StreamLog:
    """POST `payload` to `url` and record the SSE stream in `log` (cancel to disconnect)."""
    log.sent = time.monotonic()
    async with client.stream("POST", url, json=payload, headers=headers) as response:
        log.status = response.status_code
        log.headers = dict(response.headers)
        if response.status_code != 200:
            log.error = json.loads(await response.aread()).get("error")
            log.done = time.monotonic()
            return log
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                log.chunk_times.append(time.monotonic())
                log.text += "".join(c.get("text") or "" for c in chunk["choices"])
                log.last = chunk
            if chunk.get("usage"):
                log.tokens = int(chunk["usage"]["completion_tokens"])
    log.done = time.monotonic()
    return log


async def cancel(task: asyncio.Task[Any]) -> None:
    """Cancel a client task (closing its connection) and wait for it to unwind."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
        await task


@dataclass(frozen=True)
class RawReply:
    """One reply of `flood`: status, seconds from the write to the whole reply, headers, body."""

    status: int
    seconds: float
    headers: dict[str, str]
    body: bytes


async def flood(host: str, port: int, path: str, payloads: list[dict[str, Any]],
                timeout_s: float) -> list[RawReply]:
    """Send every payload at once, each on its own already-open keep-alive connection.

    A hand-rolled HTTP/1.1 client: with `httpx` the client itself needs seconds of CPU to
    issue 200 requests at once on two shared cores, which would be timed as the gateway's
    latency. Here the connections are opened (and warmed with `/healthz`) first, so the clock
    covers only the gateway's answer.
    """
    conns = [await asyncio.open_connection(host, port) for _ in payloads]
    try:
        await asyncio.gather(*(_exchange(c, _request("GET", "/healthz", None)) for c in conns))
        requests = [_request("POST", path, p) for p in payloads]
        return list(await asyncio.wait_for(
            asyncio.gather(*(_exchange(c, r) for c, r in zip(conns, requests, strict=True))),
            timeout_s))
    finally:
        for _, writer in conns:
            writer.close()


def _request(method: str, path: str, payload: dict[str, Any] | None) -> bytes:
    data = b"" if payload is None else json.dumps(payload).encode()
    head = (f"{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n")
    return head.encode() + data


async def _exchange(
    conn: tuple[asyncio.StreamReader, asyncio.StreamWriter], request: bytes
) -> RawReply:
    reader, writer = conn
    start = time.monotonic()
    writer.write(request)
    await writer.drain()
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    fields = (h.partition(":") for h in head[1:] if h)
    headers = {k.strip().lower(): v.strip() for k, _, v in fields}
    payload = await reader.readexactly(int(headers.get("content-length", "0")))
    return RawReply(int(head[0].split()[1]), time.monotonic() - start, headers, payload)
