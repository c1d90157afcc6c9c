"""Hostile WebSocket clients (issue 26, findings 3, 9, 10): every bound read from the wire.

A socket is authenticated on its upgrade, before it is accepted; it may send at most
`ws.MAX_PENDING` requests ahead of the one streamed (the rest are refused, not queued); a
request id is bounded before it is echoed; a silent socket is closed at its idle deadline; a
keyless gateway refuses a cross-site upgrade; and no key reaches a debug log.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from llmflow.gateway.ws import MAX_PENDING, PROTOCOL, FrameRedactor, key_subprotocol
from tests.gateway.harness import Harness, start_gateway, until

from .wire import exchange

pytestmark = pytest.mark.anyio

KEY = "sk-hostile-4f1e9a7c2b3d5e6f"
TENANTS = [{"name": "acme", "tier": "normal", "api_keys": [KEY]}]


def _url(h: Harness) -> str:
    return h.url.replace("http://", "ws://") + "/v1/ws"


def _request(rid: Any, **body: Any) -> str:
    chat = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], **body}
    return json.dumps({"type": "request", "id": rid, "endpoint": "chat", "body": chat})


async def _replies(ws: ClientConnection, quiet_s: float = 0.3) -> list[dict[str, Any]]:
    out = []
    while True:
        try:
            out.append(json.loads(await asyncio.wait_for(ws.recv(), quiet_s)))
        except TimeoutError:
            return out


def _upgrade(extra: str = "") -> bytes:
    return (
        "GET /v1/ws HTTP/1.1\r\nhost: 127.0.0.1\r\nupgrade: websocket\r\nconnection: Upgrade\r\n"
        "sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\nsec-websocket-version: 13\r\n"
        f"{extra}\r\n"
    ).encode()


async def test_a_wrong_key_is_refused_before_the_upgrade_is_accepted() -> None:
    async with start_gateway(tenants=TENANTS) as h:
        browser = f"sec-websocket-protocol: {PROTOCOL}, {key_subprotocol('wrong')}\r\n"
        for extra in ("", "authorization: Bearer wrong\r\n", browser):
            reply = await exchange(h.url, _upgrade(extra), timeout_s=3)
            assert reply.startswith(b"HTTP/1.1 401"), reply[:200]  # never 101 Switching
            assert b'"invalid_api_key"' in reply
        good = f"sec-websocket-protocol: {PROTOCOL}, {key_subprotocol(KEY)}\r\n"
        reply = await exchange(h.url, _upgrade(good), timeout_s=0.5)
        assert reply.startswith(b"HTTP/1.1 101")
        assert b"sec-websocket-protocol: llmflow.v1\r\n" in reply.lower()
        assert key_subprotocol(KEY).encode() not in reply  # the key is never echoed
        assert h.fake.seen == 0


async def test_requests_sent_ahead_are_bounded_and_the_rest_refused() -> None:
    """A client sending 40 requests of 256 KiB behind a stream it never acks: at most
    MAX_PENDING wait; every other one gets a 429 at once (on main all 40 queued, unbounded)."""
    pad = "x" * (256 * 1024)
    config = {"client_window": 1, "stall_timeout_ms": 60_000}
    async with start_gateway(backpressure=config) as h, connect(_url(h), max_size=None) as ws:
        await ws.send(_request("first", max_tokens=50, fake={"step": True}))
        for i in range(40):
            await ws.send(_request(i, max_tokens=1, fake={"pad": pad}))
        replies = await _replies(ws, 1.0)
        refused = [r for r in replies if r["type"] == "error"]
        assert len(refused) == 40 - MAX_PENDING, replies[:3]
        assert {r["status"] for r in refused} == {429}
        assert {r["error"]["code"] for r in refused} == {"too_many_pending_requests"}
        assert sorted(r["id"] for r in refused) == list(range(MAX_PENDING, 40))
        h.fake.release(50)
        await ws.send(json.dumps({"type": "cancel"}))
        await until(lambda: h.fake.running == 0)


async def test_a_huge_request_id_is_refused_not_echoed_in_every_frame(h_plain: Harness) -> None:
    async with connect(_url(h_plain), max_size=None) as ws:
        await ws.send(_request("i" * 100_000, max_tokens=3))
        (reply,) = await _replies(ws)
        assert (reply["status"], reply["error"]["param"], reply["id"]) == (400, "id", None)
        await ws.send(_request({"nested": "object"}, max_tokens=3))
        (reply,) = await _replies(ws)
        assert reply["status"] == 400
        await ws.send(_request("fine", max_tokens=2))  # the socket still serves
        start = (await _replies(ws))[0]
        assert (start["type"], start["id"]) == ("start", "fine")
    assert h_plain.fake.seen == 1


async def test_a_silent_socket_is_closed_at_its_idle_deadline() -> None:
    async with start_gateway(server={"ws_idle_timeout_ms": 300}) as h:
        async with connect(_url(h)) as ws:
            loop = asyncio.get_running_loop()
            start = loop.time()
            with pytest.raises(ConnectionClosed) as closed:
                await asyncio.wait_for(ws.recv(), 5)
            assert loop.time() - start < 2.0
            assert closed.value.rcvd is not None
            assert closed.value.rcvd.code == 1000
        # a socket streaming a request is not idle, however slowly its client renders
        async with connect(_url(h)) as ws:
            await ws.send(_request("slow", max_tokens=3, fake={"ttft": 0.6}))
            replies = []
            while not replies or replies[-1]["type"] != "end":
                replies.append(json.loads(await asyncio.wait_for(ws.recv(), 3)))
                if replies[-1]["type"] == "chunk":
                    await ws.send(json.dumps({"type": "ack", "seq": replies[-1]["seq"]}))
            assert replies[-1]["reason"] == "completed"


async def test_the_idle_deadline_runs_from_the_end_of_the_last_reply() -> None:
    # The client sends nothing while a 2.6 s reply streams (a window of 8 holds its chunks),
    # then acks the last chunk 0.7 s after the end: still within the 1 s idle deadline, which
    # runs from the reply's end, not from the client's last frame (that would have closed the
    # socket some 0.4 s after the end, under the client's ack).
    async with start_gateway(server={"ws_idle_timeout_ms": 1000}) as h, connect(_url(h)) as ws:
        await ws.send(_request("long", max_tokens=3, fake={"ttft": 2.6}))
        replies = []
        while not replies or replies[-1]["type"] != "end":
            replies.append(json.loads(await asyncio.wait_for(ws.recv(), 5)))
        assert replies[-1]["reason"] == "completed"
        await asyncio.sleep(0.7)
        await ws.send(json.dumps({"type": "ack", "id": "long", "seq": replies[-1]["sent"]}))
        with pytest.raises(ConnectionClosed) as closed:  # then idle: closed at its deadline
            await asyncio.wait_for(ws.recv(), 5)
        assert closed.value.rcvd is not None
        assert closed.value.rcvd.code == 1000


async def test_a_keyless_gateway_refuses_a_cross_site_upgrade(h_plain: Harness) -> None:
    with pytest.raises(InvalidStatus) as refused:
        await connect(_url(h_plain), origin="https://evil.example")  # type: ignore[arg-type]
    assert refused.value.response.status_code == 403
    rebound = _upgrade().replace(b"host: 127.0.0.1", b"host: evil.example:80")  # DNS rebinding
    reply = await exchange(h_plain.url, rebound, timeout_s=3)
    assert reply.startswith(b"HTTP/1.1 403"), reply[:300]
    assert b"server.allowed_hosts" in reply
    own = h_plain.url  # a same-origin page (the playground) keeps working
    async with connect(_url(h_plain), origin=own, subprotocols=[PROTOCOL]) as ws:  # type: ignore[arg-type, list-item]
        await ws.send(_request("ok", max_tokens=1))
        assert (await _replies(ws))[0]["type"] == "start"
    assert h_plain.fake.seen == 1


async def test_no_key_reaches_a_debug_log_of_the_handshake() -> None:
    """The websockets library logs every handshake header at DEBUG on uvicorn's logger;
    `llmflow serve` installs `FrameRedactor` there (tests/gateway/test_admin.py runs the CLI)."""
    logger = logging.getLogger("uvicorn.error")
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler, redactor, level = Keep(), FrameRedactor(), logger.level
    try:
        async with start_gateway(tenants=TENANTS) as h:
            logger.addFilter(redactor)  # after uvicorn's own logging config, which resets it
            logger.addHandler(handler)
            logger.setLevel(logging.DEBUG)
            headers = {"authorization": f"Bearer {KEY}"}
            async with connect(_url(h), additional_headers=headers) as ws:
                await ws.send(_request("a", max_tokens=1))
                await _replies(ws)
            async with connect(_url(h), subprotocols=[PROTOCOL, key_subprotocol(KEY)]) as ws:  # type: ignore[list-item]
                await ws.send(_request("b", max_tokens=1))
                await _replies(ws)
    finally:
        logger.removeFilter(redactor)
        logger.removeHandler(handler)
        logger.setLevel(level)
    text = "\n".join(lines)
    assert "authorization" in text.lower()  # the handshake was logged ...
    assert KEY not in text  # ... without the key, in either form
    assert key_subprotocol(KEY)[12:] not in text


@pytest.fixture
async def h_plain() -> Any:
    async with start_gateway() as h:
        yield h
