"""The WebSocket acknowledgement protocol: never more than `client_window` unacknowledged."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import InvalidStatus

from llmflow.gateway.ws import PROTOCOL, key_subprotocol

from .harness import Harness, start_gateway

pytestmark = pytest.mark.anyio


def _request(rid: str = "r1", tokens: int = 30, **fake: Any) -> str:
    body = {
        "model": "fake-model",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": tokens,
        "fake": fake,
    }
    return json.dumps({"type": "request", "id": rid, "endpoint": "chat", "body": body})


async def _recv(ws: ClientConnection, timeout: float = 3.0) -> dict[str, Any]:
    return json.loads(await asyncio.wait_for(ws.recv(), timeout))  # type: ignore[no-any-return]


def _ws_url(h: Harness) -> str:
    return h.url.replace("http://", "ws://") + "/v1/ws"


async def _drain_window(ws: ClientConnection, timeout: float = 0.2) -> list[dict[str, Any]]:
    out = []
    while True:
        try:
            out.append(await _recv(ws, timeout))
        except TimeoutError:
            return out


async def test_server_never_exceeds_the_window_and_resumes_on_ack() -> None:
    async with start_gateway(backpressure={"client_window": 3}) as h, connect(_ws_url(h)) as ws:
        await ws.send(_request(tokens=30))
        start = await _recv(ws)
        (session,) = h.gateway.ctx.sessions  # type: ignore[union-attr]
        assert start == {  # request_id: the gateway's id, its row in /api/state
            "type": "start",
            "id": "r1",
            "window": 3,
            "request_id": session.request_id,
        }
        got = await _drain_window(ws, 0.6)
        assert [m["seq"] for m in got] == [1, 2, 3]  # then silence: no acks yet
        text = ""
        acked = 0
        while True:
            chunks = [m for m in got if m["type"] == "chunk"]
            for m in chunks:
                assert m["seq"] - acked <= 3
                text += "".join(
                    (c.get("delta") or {}).get("content") or "" for c in m["data"]["choices"]
                )
            if any(m["type"] == "end" for m in got):
                break
            acked = chunks[-1]["seq"] if chunks else acked
            await ws.send(json.dumps({"type": "ack", "id": "r1", "seq": acked}))
            got = [await _recv(ws)]
            got += await _drain_window(ws, 0.05)
        assert text == "".join(f"t{i} " for i in range(30))
        assert got[-1]["reason"] == "completed"


async def test_a_late_renderer_gets_merged_chunks_and_the_backend_is_paused() -> None:
    async with start_gateway(backpressure={"client_window": 2}) as h:
        async with connect(_ws_url(h)) as ws:
            await ws.send(_request(tokens=200, itl=0.005))
            await _recv(ws)
            first = await _drain_window(ws, 0.6)
            assert len(first) == 2
            (session,) = h.gateway.ctx.sessions  # type: ignore[union-attr]
            assert session.window.pauses > 0  # the window filled and the reader paused
            assert session.parser.completion_tokens < 200
            await ws.send(json.dumps({"type": "ack", "seq": 2}))
            merged = await _drain_window(ws)
            assert 1 <= len(merged) <= 2
            assert max(len(m["data"]["choices"][0]["delta"]["content"]) for m in merged) > 4
            await ws.send(json.dumps({"type": "cancel"}))
        await h.settle()
        assert h.fake.aborted == 1


async def test_errors_come_as_messages_with_status(gw: Harness) -> None:
    async with connect(_ws_url(gw)) as ws:
        body = json.loads(_request())
        body["body"]["model"] = "nope"
        await ws.send(json.dumps(body))
        error = await _recv(ws)
        assert (error["type"], error["status"], error["error"]["code"]) == (
            "error",
            404,
            "model_not_found",
        )
        await ws.send(_request("r2", tokens=2))  # the socket serves the next request
        assert (await _recv(ws))["type"] == "start"


async def test_keys_are_checked_on_the_upgrade_before_it_is_accepted() -> None:
    tenants = [{"name": "t", "tier": "vip", "api_keys": ["k1"]}]
    async with start_gateway(tenants=tenants) as h:
        for headers, protocols in (
            ({}, None),  # no key at all
            ({"authorization": "Bearer nope"}, None),
            ({}, [PROTOCOL, key_subprotocol("nope")]),
            ({}, [PROTOCOL, "llmflow.key.!!!"]),  # not base64url
        ):
            with pytest.raises(InvalidStatus) as refused:
                await connect(_ws_url(h), additional_headers=headers, subprotocols=protocols)
            response = refused.value.response
            assert response.status_code == 401
            assert json.loads(response.body)["error"]["code"] == "invalid_api_key"
        assert h.fake.seen == 0
        async with connect(_ws_url(h), additional_headers={"authorization": "Bearer k1"}) as ws:
            assert ws.subprotocol is None
            await ws.send(_request(tokens=1))
            assert (await _recv(ws))["type"] == "start"
        # a browser: the key in a subprotocol, accepted as llmflow.v1 (never echoing the key)
        async with connect(_ws_url(h), subprotocols=[PROTOCOL, key_subprotocol("k1")]) as ws:
            assert ws.subprotocol == PROTOCOL
            await ws.send(_request("r2", tokens=2))
            assert (await _recv(ws))["type"] == "start"
            # the per-message key is no longer read: it is refused, saying where the key goes
            await _drain_window(ws)
            await ws.send(json.dumps({**json.loads(_request("r3", tokens=2)), "api_key": "k1"}))
            error = await _recv(ws)
            assert (error["status"], error["error"]["param"]) == (400, "api_key")


async def test_a_keyless_gateway_accepts_with_or_without_the_subprotocol(gw: Harness) -> None:
    async with connect(_ws_url(gw), subprotocols=[PROTOCOL]) as ws:
        assert ws.subprotocol == PROTOCOL
        await ws.send(_request(tokens=1))
        assert (await _recv(ws))["type"] == "start"
    async with connect(_ws_url(gw)) as ws:
        assert ws.subprotocol is None


async def test_closing_the_socket_mid_stream_aborts_upstream(gw: Harness) -> None:
    async with connect(_ws_url(gw)) as ws:
        await ws.send(_request(tokens=500, itl=0.01))
        await _recv(ws)
        await _recv(ws)
    await gw.settle()
    assert gw.fake.aborted == 1


async def test_a_silent_client_is_aborted_after_the_stall_timeout() -> None:
    config = {"client_window": 2, "stall_timeout_ms": 200}
    async with start_gateway(backpressure=config) as h, connect(_ws_url(h)) as ws:
        await ws.send(_request(tokens=500, itl=0.005))
        await _recv(ws)
        await asyncio.sleep(0.6)
        await h.settle()
        assert h.fake.aborted == 1
        assert h.gateway.metrics.outcomes["cancelled", "client_stall"] == 1
        # what waited in the socket, then the end, for a client that reads again
        got = await _drain_window(ws)
        assert [m["type"] for m in got] == ["chunk", "chunk", "end"]
        assert (got[-1]["reason"], got[-1]["sent"]) == ("client_stall", 2)
