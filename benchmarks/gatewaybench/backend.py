"""The fake vLLM: an OpenAI-format SSE server with no framework in the way.

It has to cost the same in every arm and stay far below the gateways under test, so it is a
bare `asyncio.Protocol` (on uvloop) that schedules each token with one `call_at` at an absolute
time (no task per stream, no drift) and writes pre-built event bytes. Each request carries its
plan in the prompt text (`bench ttft_ms=20 itl_ms=10 hold=0`), because a gateway may drop
unknown JSON fields on the way but never the messages.

Endpoints: `POST /v1/chat/completions` (streamed), `GET /health` and `GET /v1/models` (what
vllm-router probes before it takes traffic: it polls `/health` every
`--worker-startup-check-interval` seconds), and `GET /metrics` with the gauges llmflow's scraper
reads, including `vllm:cache_config_info`, so that llmflow's KV ledger learns a block count and
is active as it would be in front of a real vLLM.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from dataclasses import dataclass
from typing import Any, cast

MODEL = "bench"
NUM_GPU_BLOCKS = 262_144  # 4 M tokens of KV at 16 per block: 5,000 held streams use < 15%
BLOCK_SIZE = 16
_PROMPT_TOKENS = 8
_PLAN = re.compile(r"(\w+)=([\d.]+)")


@dataclass(frozen=True, slots=True)
class Plan:
    """What one request asks of the backend."""

    tokens: int
    ttft_s: float
    itl_s: float
    hold: bool  # send the first token, then nothing until the client goes away
    usage: bool  # continuous usage stats (llmflow asks for them upstream, as vLLM allows)


def plan_text(ttft_ms: float, itl_ms: float, hold: bool) -> str:
    """The prompt that carries a plan to the backend through any gateway."""
    return f"bench ttft_ms={ttft_ms:g} itl_ms={itl_ms:g} hold={int(hold)}"


def _parse_plan(body: dict[str, Any]) -> Plan:
    messages = body.get("messages") or [{}]
    fields = dict(_PLAN.findall(str(messages[-1].get("content", ""))))
    options = body.get("stream_options") or {}
    return Plan(
        tokens=int(body.get("max_tokens") or 16),
        ttft_s=float(fields.get("ttft_ms", 0)) / 1e3,
        itl_s=float(fields.get("itl_ms", 0)) / 1e3,
        hold=fields.get("hold", "0") == "1",
        usage=bool(options.get("continuous_usage_stats")),
    )


_EVENTS: dict[tuple[int, int, bool], bytes] = {}


def _event(i: int, tokens: int, usage: bool) -> bytes:
    """Event `i` of `tokens` as one HTTP chunk, built once per shape and reused."""
    key = (i, tokens, usage)
    cached = _EVENTS.get(key)
    if cached is not None:
        return cached
    last = i == tokens - 1
    finish = '"length"' if last else "null"
    extra = (
        f',"usage":{{"prompt_tokens":{_PROMPT_TOKENS},"completion_tokens":{i + 1},'
        f'"total_tokens":{i + 1 + _PROMPT_TOKENS}}}'
        if usage
        else ""
    )
    data = (
        f'data: {{"id":"chatcmpl-b","object":"chat.completion.chunk","created":1,'
        f'"model":"{MODEL}","choices":[{{"index":0,"delta":{{"content":"t{i} "}},'
        f'"logprobs":null,"finish_reason":{finish}}}]{extra}}}\n\n'
    ).encode()
    if last:
        data += b"data: [DONE]\n\n"
    chunk = b"%x\r\n%s\r\n" % (len(data), data)
    if last:
        chunk += b"0\r\n\r\n"
    _EVENTS[key] = chunk
    return chunk


_SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
    b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n"
)


def _reply(status: str, ctype: str, body: bytes) -> bytes:
    return (
        f"HTTP/1.1 {status}\r\ncontent-type: {ctype}\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode() + body


class _Stats:
    """Live streams and their KV blocks, for `/metrics`."""

    running = 0
    blocks = 0


class _Wheel:
    """Token times rounded up to the millisecond, one timer per busy millisecond.

    With a timer per token the backend would wake 25,600 times a second at 256 streams (and
    wake the clients as often); grouping the tokens due in the same millisecond costs at most
    1 ms of jitter, the same in every arm, and leaves most of CPU 0 to spare.
    """

    def __init__(self) -> None:
        self.slots: dict[int, list[tuple[BackendConn, int]]] = {}

    def add(self, loop: asyncio.AbstractEventLoop, at: float, conn: BackendConn) -> None:
        slot = math.ceil(at * 1e3)
        due = self.slots.get(slot)
        if due is None:
            self.slots[slot] = due = []
            loop.call_at(slot / 1e3, self._fire, slot)
        due.append((conn, conn.seq))

    def _fire(self, slot: int) -> None:
        for conn, seq in self.slots.pop(slot, ()):
            conn.tick(seq)


_WHEEL = _Wheel()


class BackendConn(asyncio.Protocol):
    """One keep-alive connection: requests in order, one streamed response at a time."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.plan: Plan | None = None  # the response in progress
        self.seq = 0  # which request a scheduled tick belongs to
        self.t0 = 0.0
        self.next_i = 0
        self.blocks = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast("asyncio.Transport", transport)  # uvloop's is no subclass

    def connection_lost(self, exc: Exception | None) -> None:
        self._end()
        self.transport = None

    def data_received(self, data: bytes) -> None:
        self.buf += data
        self._serve_next()

    def _serve_next(self) -> None:
        while self.plan is None and self.transport is not None:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(self.buf[:end]).decode("latin-1")
            line, _, rest = head.partition("\r\n")
            match = re.search(r"(?im)^content-length:\s*(\d+)", rest)
            length = int(match.group(1)) if match else 0
            if len(self.buf) < end + 4 + length:
                return
            body = bytes(self.buf[end + 4 : end + 4 + length])
            del self.buf[: end + 4 + length]
            self._route(line.split(" ")[:2], body)

    def _route(self, method_path: list[str], body: bytes) -> None:
        assert self.transport is not None
        method, path = ([*method_path, "", ""])[:2]
        if method == "POST" and path.endswith("/completions"):
            self._start(_parse_plan(json.loads(body)))
        elif path == "/metrics":
            self.transport.write(_reply("200 OK", "text/plain", _metrics()))
        elif path == "/health":
            self.transport.write(_reply("200 OK", "application/json", b"{}"))
        elif path == "/v1/models":
            models = {"object": "list", "data": [{"id": MODEL, "object": "model"}]}
            self.transport.write(_reply("200 OK", "application/json", json.dumps(models).encode()))
        else:
            self.transport.write(_reply("404 Not Found", "application/json", b"{}"))

    def _start(self, plan: Plan) -> None:
        assert self.transport is not None
        self.plan, self.next_i, self.seq = plan, 0, self.seq + 1
        self.blocks = math.ceil((_PROMPT_TOKENS + plan.tokens) / BLOCK_SIZE)
        _Stats.running += 1
        _Stats.blocks += self.blocks
        self.transport.write(_SSE_HEAD)
        self.t0 = self.loop.time()
        _WHEEL.add(self.loop, self.t0 + plan.ttft_s, self)

    def tick(self, seq: int) -> None:
        """Send the next token (the wheel calls this at its time)."""
        plan, transport = self.plan, self.transport
        if plan is None or transport is None or seq != self.seq:
            return  # the request this tick was for has ended
        i = self.next_i
        transport.write(_event(i, plan.tokens, plan.usage))
        if i == plan.tokens - 1:
            self._end()
            self._serve_next()
            return
        self.next_i = i + 1
        if not plan.hold:  # held: no more tokens until the client leaves
            _WHEEL.add(self.loop, self.t0 + plan.ttft_s + (i + 1) * plan.itl_s, self)

    def _end(self) -> None:
        if self.plan is not None:
            _Stats.running -= 1
            _Stats.blocks -= self.blocks
            self.plan = None


def _metrics() -> bytes:
    labels = f'engine="0",model_name="{MODEL}"'
    usage = _Stats.blocks / NUM_GPU_BLOCKS
    return (
        f"vllm:num_requests_running{{{labels}}} {_Stats.running}\n"
        f"vllm:num_requests_waiting{{{labels}}} 0\n"
        f"vllm:kv_cache_usage_perc{{{labels}}} {usage:.6f}\n"
        f"vllm:num_preemptions_total{{{labels}}} 0\n"
        f'vllm:cache_config_info{{block_size="{BLOCK_SIZE}",'
        f'num_gpu_blocks="{NUM_GPU_BLOCKS}",engine="0"}} 1.0\n'
    ).encode()


async def serve(port: int) -> None:
    """Serve on 127.0.0.1:`port` until cancelled."""
    loop = asyncio.get_running_loop()
    server = await loop.create_server(BackendConn, "127.0.0.1", port, backlog=8192)
    async with server:
        await server.serve_forever()
