"""The flight recorder end to end: `llmflow serve --trace` under abuse, replayed and checked.

A real gateway process in front of two real `llmflow simserve` processes takes a flood, clients
that leave, deadlines, a stalled WebSocket client and a backend killed mid-stream, then drains
on SIGTERM. Its trace must replay bit for bit (`llmflow trace replay`), and what every client
saw (status, Retry-After, the cut's reason) must be exactly an action in the trace, found by the
`X-Request-Id` the gateway answered with.
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import websockets

from tests.processes import GatewayProcess, SimServeProcess, replays_exactly

from .sse_client import frames

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

MODEL = "sim"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}]}


def _config(urls: list[str]) -> dict[str, Any]:
    return {
        "gate": {"max_concurrency_per_gpu": 3, "queue": {"max_waiting": 6, "max_wait_ms": 4000}},
        "timeouts": {"total_ms": 2500},
        "backpressure": {"client_window": 2, "stall_timeout_ms": 400},
        "streaming": {"sse_flush_interval": 0},
        "metrics": {"scrape_interval_ms": 100},
        "server": {"drain_timeout_ms": 1000},
        "backends": [
            {"name": f"b{i}", "url": url, "models": [MODEL], "max_model_len": 8192}
            for i, url in enumerate(urls)
        ],
    }


def _terminals(trace: str) -> dict[int, dict[str, Any]]:
    """Request id -> its terminal action (`reply`, `cut` or `end`), from a JSONL trace."""
    out: dict[int, dict[str, Any]] = {}
    for line in trace.splitlines()[1:]:
        for action in json.loads(line).get("act", []):
            (kind, body), = action.items()
            if kind in ("reply", "cut", "end"):
                assert body["id"] not in out, f"request {body['id']} ended twice"
                out[body["id"]] = {"kind": kind, **body}
    return out


class Seen:
    """What the clients saw, by gateway request id."""

    def __init__(self) -> None:
        self.by_id: dict[int, dict[str, Any]] = {}

    def record(self, response: httpx.Response, **extra: Any) -> None:
        rid = response.headers.get("x-request-id")
        assert rid is not None, response.headers
        assert rid.startswith("llmflow-"), rid
        self.by_id[int(rid.removeprefix("llmflow-"))] = {
            "status": response.status_code,
            "retry_after": response.headers.get("retry-after"),
            **extra,
        }


async def _plain(client: httpx.AsyncClient, seen: Seen, **body: Any) -> None:
    r = await client.post("/v1/chat/completions", json={**BODY, **body})
    extra: dict[str, Any] = {}
    if r.status_code == 200:
        extra["cut"] = (r.json().get("llmflow") or {}).get("reason")
    seen.record(r, **extra)


async def _streamed(
    client: httpx.AsyncClient, seen: Seen, leave_after: int | None = None, **body: Any
) -> None:
    async with client.stream(
        "POST", "/v1/chat/completions", json={**BODY, **body, "stream": True}
    ) as r:
        if r.status_code != 200:
            await r.aread()
            seen.record(r)
            return
        chunks = []
        async for chunk in frames(r):
            chunks.append(chunk)
            ended = chunk == "[DONE]" or "llmflow" in chunk or "error" in chunk
            if leave_after is not None and len(chunks) >= leave_after and not ended:
                seen.record(r, left=True)
                return  # the client goes away mid-stream
    last = [c for c in chunks if isinstance(c, dict)][-1]
    seen.record(
        r,
        cut=(last.get("llmflow") or {}).get("reason"),
        error=last.get("error") is not None,
        done=chunks[-1] == "[DONE]",
    )


async def _stalled_websocket(url: str) -> None:
    """Ask for a long stream over the ack protocol and never acknowledge a chunk."""
    async with websockets.connect(url.replace("http", "ws") + "/v1/ws") as ws:
        await ws.send(json.dumps({
            "type": "request", "id": "stall", "endpoint": "chat",
            "body": {**BODY, "max_tokens": 3000, "ignore_eos": True},
        }))
        await asyncio.sleep(3.0)  # owes the window the whole time: the stall timer cuts it


async def test_a_gateway_trace_replays_and_matches_what_clients_saw(tmp_path: Path) -> None:
    trace_path = tmp_path / "gateway.jsonl"
    with (
        SimServeProcess(tmp_path, "--model-name", MODEL, "--speed", "4") as steady,
        SimServeProcess(tmp_path, "--model-name", MODEL, "--speed", "4") as doomed,
    ):
        gateway = GatewayProcess(
            _config([steady.url, doomed.url]), tmp_path, extra_args=("--trace", str(trace_path))
        )
        with gateway:
            seen = Seen()
            async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
                # A stalled WebSocket client first (an idle gateway puts it on b0, which
                # lives), long streams on both backends (into the 2.5 s deadline), clients that
                # leave, then a flood that overflows the queue.
                stall = asyncio.create_task(_stalled_websocket(gateway.url))
                await asyncio.sleep(0.2)
                long = [
                    asyncio.create_task(
                        _streamed(client, seen, max_tokens=4000, ignore_eos=True)
                    )
                    for _ in range(4)
                ]
                leavers = [
                    asyncio.create_task(
                        _streamed(client, seen, leave_after=3, max_tokens=500, ignore_eos=True)
                    )
                    for _ in range(2)
                ]
                await asyncio.sleep(0.3)
                flood = [
                    asyncio.create_task(_plain(client, seen, max_tokens=16))
                    for _ in range(40)
                ]
                await asyncio.sleep(0.5)
                doomed.kill()  # a backend dies with streams in flight
                await asyncio.gather(*long, *leavers, *flood, stall)
                # After the failure, traffic goes to the live backend; two more clients leave.
                await asyncio.gather(
                    *(_plain(client, seen, max_tokens=8) for _ in range(3)),
                    *(
                        _streamed(client, seen, leave_after=2, max_tokens=500, ignore_eos=True)
                        for _ in range(2)
                    ),
                )
            assert gateway.stop() == 0  # SIGTERM: drained, exit 0
        trace = trace_path.read_text(encoding="utf-8")

    replays_exactly(trace_path)

    terminals = _terminals(trace)
    kinds = {(t["kind"], t.get("reason") or t.get("outcome")) for t in terminals.values()}
    # Everything the scenario was built to cause happened, as the runtime decided it.
    assert any(t["kind"] == "reply" and t["status"] == 429 for t in terminals.values()), kinds
    for expected in [
        ("cut", "deadline"),
        ("cut", "client_stall"),
        ("end", "cancelled"),
        ("end", "completed"),
    ]:
        assert expected in kinds, (expected, sorted(kinds))
    assert any(k[0] in ("reply", "cut") and k[1] == "upstream_error" for k in kinds), kinds
    assert '"backend":{"backend":1,"healthy":false}' in trace

    # Each client saw exactly what the runtime said, and nothing it did not say.
    assert len(seen.by_id) == 4 + 2 + 40 + 3 + 2
    for rid, got in seen.by_id.items():
        action = terminals[rid]
        history = [line for line in trace.splitlines() if f'"id":{rid},' in line]
        got["history"] = [*history[:3], "...", *history[-3:]]
        if got.get("left"):
            assert (action["kind"], action.get("outcome")) == ("end", "cancelled"), (rid, action)
        elif got["status"] != 200:
            assert action["kind"] == "reply", (rid, got, action)
            assert action["status"] == got["status"], (rid, got, action)
            wire = action["retry_after_s"]
            assert got["retry_after"] == (None if wire is None else str(wire)), (rid, got, action)
        elif got.get("error"):
            assert (action["kind"], action["reason"]) == ("cut", "upstream_error"), (rid, action)
        elif got.get("cut"):
            assert (action["kind"], action["reason"]) == ("cut", got["cut"]), (rid, action)
        else:
            assert (action["kind"], action.get("outcome")) == ("end", "completed"), (rid, got)
    refused = [g for g in seen.by_id.values() if g["status"] == 429]
    assert refused, "the flood was not refused"
