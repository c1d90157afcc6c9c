"""The instrumented fake vLLM the conformance suite points a gateway at.

It speaks vLLM's OpenAI surface (`POST /v1/chat/completions` and `/v1/completions`, streamed
as SSE or whole; `GET /v1/models`, `/health`, `/metrics` with the gauges vLLM-aware gateways
scrape) and counts, from outside the gateway, what the gateway did to it: requests received,
running now and at the peak, each request's end (completed, or aborted: the gateway closed
the connection first) and when, the tokens and bytes it sent.

Each request carries its plan in the prompt text (`conformance tag=f3 tokens=10 itl_ms=100`),
because a gateway may drop unknown JSON fields on the way but never the prompt. The `tag`
names the request, so the suite finds its record. With `limit` set the reply sends padded
tokens until that many bytes have gone, then holds: a generation longer than any bound, that
ends only when the gateway goes away (the stalled-client check).

A plain ASGI app: the disconnect listener is its own (a task reading `http.disconnect`), so an
abort is seen the moment the server sees the connection close, whatever the ASGI spec version.
It runs in a thread of the suite's process (`BackendServer`) so the suite reads its counters
and clocks directly, or on its own (`llmflow conformance-backend`), where the suite reads them
from `GET /_conformance/state` (`remote.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import uvicorn

from llmflow.conformance.frames import MODEL, Frames, whole

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from starlette.types import Receive, Scope, Send

__all__ = ["MODEL", "Backend", "BackendServer", "BackendView", "Plan", "Record", "plan_text"]

MAX_MODEL_LEN = 1_000_000  # tokens: the stalled-client plan asks for many
NUM_GPU_BLOCKS = 1_000_000  # KV blocks of 16 tokens, never the limit
_PLAN = re.compile(r"(\w+)=([\w.-]+)")
_SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
_JSON = [(b"content-type", b"application/json")]


@dataclass(frozen=True, slots=True)
class Plan:
    """What one request asks of the backend."""

    tag: str
    tokens: int
    ttft_s: float = 0.0
    itl_s: float = 0.0
    pad: int = 0  # bytes of each token's text (0: "tN ")
    limit: int = 0  # bytes after which the reply holds until the gateway goes away (0: none)


def plan_text(plan: Plan) -> str:
    """The prompt that carries `plan` through any gateway."""
    return (
        f"conformance tag={plan.tag} tokens={plan.tokens} ttft_ms={plan.ttft_s * 1e3:g} "
        f"itl_ms={plan.itl_s * 1e3:g} pad={plan.pad} limit={plan.limit}"
    )


def _parse_plan(body: dict[str, Any]) -> Plan:
    messages = body.get("messages")
    if isinstance(messages, list) and messages and isinstance(messages[-1], dict):
        text = str(messages[-1].get("content", ""))
    else:
        text = str(body.get("prompt", ""))
    fields = dict(_PLAN.findall(text))
    tokens = fields.get("tokens") or body.get("max_tokens") or 8
    return Plan(
        tag=fields.get("tag", ""),
        tokens=int(tokens),
        ttft_s=float(fields.get("ttft_ms", 0)) / 1e3,
        itl_s=float(fields.get("itl_ms", 0)) / 1e3,
        pad=int(fields.get("pad", 0)),
        limit=int(fields.get("limit", 0)),
    )


@dataclass
class Record:
    """One request as the backend saw it (times on `time.monotonic()`)."""

    tag: str
    received_at: float
    ended_at: float | None = None
    outcome: str = "running"  # "completed", or "aborted": the gateway left first
    tokens: int = 0
    bytes_sent: int = 0


class BackendView(Protocol):
    """What the suite reads of its backend: this process's `Backend`, or a standing one
    mirrored over HTTP (`remote.RemoteBackend`)."""

    running: int
    peak_running: int
    records: dict[str, list[Record]]

    def runs(self, tag: str) -> list[Record]:
        """Every request the backend received with `tag`."""

    async def next_phase(self) -> int:
        """The peak running since the last call."""

    async def sync(self) -> None:
        """Bring `running`, `records` and `runs` up to the backend's state as of now."""


@dataclass
class Backend:
    """The fake's counters and its ASGI app (call the instance)."""

    model: str = MODEL
    received: int = 0
    running: int = 0
    peak_running: int = 0
    phase_peak: int = 0  # the peak since the suite last reset it (one phase's)
    completed: int = 0
    aborted: int = 0
    tokens_sent: int = 0
    records: dict[str, list[Record]] = field(default_factory=dict)

    def runs(self, tag: str) -> list[Record]:
        """Every request the backend received with `tag` (a gateway may send one twice)."""
        return self.records.get(tag, [])

    async def next_phase(self) -> int:
        """The peak running since the last call; the next phase's peak starts from now."""
        peak, self.phase_peak = self.phase_peak, self.running
        return peak

    async def sync(self) -> None:
        """Nothing to do: this is the backend itself."""

    def state(self) -> dict[str, Any]:
        """The counters and records as JSON, with this process's clock (`GET /_conformance`)."""
        return {
            "now": time.monotonic(),
            "running": self.running,
            "peak_running": self.peak_running,
            "received": self.received,
            "records": {tag: [asdict(r) for r in runs] for tag, runs in self.records.items()},
        }

    def reset(self) -> None:
        """Forget every record and peak (a new suite run against a standing backend)."""
        self.records = {}
        self.peak_running = self.phase_peak = self.running

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        path, method = scope["path"], scope["method"]
        if method == "POST" and path in ("/v1/chat/completions", "/v1/completions"):
            await self._complete(receive, send, path.endswith("chat/completions"))
        elif path == "/_conformance/state":
            await _answer(send, 200, json.dumps(self.state()).encode())
        elif path == "/_conformance/next-phase" and method == "POST":
            await _answer(send, 200, json.dumps({"peak": await self.next_phase()}).encode())
        elif path == "/_conformance/reset" and method == "POST":
            self.reset()
            await _answer(send, 200, b"{}")
        elif path == "/health":
            await _answer(send, 200, b"{}")
        elif path == "/v1/models":
            models = [{"id": self.model, "object": "model", "owned_by": "vllm",
                       "root": self.model, "max_model_len": MAX_MODEL_LEN}]
            await _answer(send, 200, json.dumps({"object": "list", "data": models}).encode())
        elif path == "/metrics":
            await _answer(send, 200, self._metrics(), [(b"content-type", b"text/plain")])
        else:
            await _answer(send, 404, b'{"error": {"message": "not found", "code": 404}}')

    def _metrics(self) -> bytes:
        labels = f'engine="0",model_name="{self.model}"'
        return (
            f"vllm:num_requests_running{{{labels}}} {float(self.running)}\n"
            f"vllm:num_requests_waiting{{{labels}}} 0.0\n"
            f"vllm:kv_cache_usage_perc{{{labels}}} 0.0\n"
            f"vllm:num_preemptions_total{{{labels}}} 0.0\n"
            f'vllm:cache_config_info{{block_size="16",num_gpu_blocks="{NUM_GPU_BLOCKS}",'
            f'engine="0"}} 1.0\n'
        ).encode()

    async def _complete(self, receive: Receive, send: Send, chat: bool) -> None:
        raw = await _read_body(receive)
        try:
            body = json.loads(raw)
            plan = _parse_plan(body)
        except (ValueError, TypeError, AttributeError):
            await _answer(send, 400, b'{"error": {"message": "bad JSON", "code": 400}}')
            return
        record = Record(plan.tag, time.monotonic())
        self.records.setdefault(plan.tag, []).append(record)
        self.received += 1
        self.running += 1
        self.peak_running = max(self.peak_running, self.running)
        self.phase_peak = max(self.phase_peak, self.running)
        reply = asyncio.ensure_future(self._reply(send, body, plan, chat, record))
        gone = asyncio.ensure_future(self._disconnected(receive, record))
        try:
            await asyncio.wait([reply, gone], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (reply, gone):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, OSError, RuntimeError):
                    await task
            self._end(record, "aborted")  # unless it ended already

    async def _disconnected(self, receive: Receive, record: Record) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self._end(record, "aborted")  # at once: the slot is free when the socket closes

    def _end(self, record: Record, outcome: str) -> None:
        if record.ended_at is not None:
            return
        record.ended_at, record.outcome = time.monotonic(), outcome
        self.running -= 1
        if outcome == "completed":
            self.completed += 1
        else:
            self.aborted += 1

    async def _reply(
        self, send: Send, body: dict[str, Any], plan: Plan, chat: bool, record: Record
    ) -> None:
        if not body.get("stream"):
            text = "".join([chunk async for chunk in self._tokens(plan, record)])
            await _answer(send, 200, json.dumps(whole(body, plan.tokens, chat, text)).encode())
            return
        await send({"type": "http.response.start", "status": 200, "headers": _SSE})
        options = body.get("stream_options") or {}
        frames = Frames(body, chat, bool(options.get("continuous_usage_stats")))
        if chat:
            await self._send(send, record, frames.role())
        i = 0
        async for text in self._tokens(plan, record):
            await self._send(send, record, frames.token(text, i, plan.tokens))
            i += 1
        if options.get("include_usage"):
            await self._send(send, record, frames.usage(plan.tokens))
        await self._send(send, record, b"data: [DONE]\n\n")
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _send(self, send: Send, record: Record, data: bytes) -> None:
        await send({"type": "http.response.body", "body": data, "more_body": True})
        if record.outcome == "aborted":  # the server drops what is sent to a closed socket
            raise ConnectionResetError("the gateway closed the connection")
        record.bytes_sent += len(data)
        await asyncio.sleep(0)  # a checkpoint per frame, so the disconnect listener runs

    async def _tokens(self, plan: Plan, record: Record) -> AsyncIterator[str]:
        await asyncio.sleep(plan.ttft_s)
        for i in range(plan.tokens):
            if i and plan.itl_s:
                await asyncio.sleep(plan.itl_s)
            if plan.limit and record.bytes_sent >= plan.limit:
                await asyncio.Event().wait()  # hold: only the gateway leaving ends it
            record.tokens += 1
            self.tokens_sent += 1
            if i == plan.tokens - 1:
                self._end(record, "completed")  # as vLLM's engine frees it: before the reply
            yield (f"t{i}".ljust(plan.pad, "x") + " ") if plan.pad else f"t{i} "


async def _read_body(receive: Receive) -> bytes:
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(chunks)
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


async def _answer(
    send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers or _JSON})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


class BackendServer:
    """A `Backend` served by uvicorn from a thread of this process.

    Args:
        backend: the fake to serve.
        host: the address to listen on.
        port: the port (0: any free one).
    """

    def __init__(self, backend: Backend, host: str = "127.0.0.1", port: int = 0) -> None:
        self.backend = backend
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.host, self.port = host, int(self._sock.getsockname()[1])
        config = uvicorn.Config(
            backend, log_level="critical", lifespan="off", access_log=False,
            timeout_keep_alive=60, backlog=4096,
        )
        self._server = uvicorn.Server(config)  # off the main thread it leaves signals alone
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )

    @property
    def url(self) -> str:
        """Base URL without `/v1`, as a gateway's backend list takes it."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> BackendServer:
        """Start serving; return once uvicorn listens."""
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the conformance backend did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Stop serving (cutting what still runs: a gateway may hold a stream forever) and
        close the socket."""
        self._server.should_exit = self._server.force_exit = True
        self._thread.join(timeout=15)
        self._sock.close()

    def __enter__(self) -> BackendServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
