"""The native front door seen from the wire: what a client sends reaches the app whole, what the
app answers reaches the client as it comes, and what the front answers itself is the answer the
Python listener (uvicorn on the port, before the front owned it) gave, byte for byte.

That listener's answers are recorded in `front_answers.json` (the clock's fields blanked), one
per case of `_CASES`, as it wrote them under the limits the first test below sets."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import struct
from pathlib import Path
from typing import Any

import pytest
from fastapi import Request  # noqa: TC002 (FastAPI reads the route's annotation at runtime)
from websockets.asyncio.client import connect

from llmflow.gateway.middleware import PeerFromFront

from .harness import Harness, start_gateway, until

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
# What differs by the second, and the request id's number (by path: the front numbers from
# its own range what it serves natively, as a chunked body now is).
_CLOCK = re.compile(rb"(\r\ndate: )[^\r]*|(\"created\":)\d+|(\r\nx-request-id: llmflow-)\d+")


def _blank(found: re.Match[bytes]) -> bytes:
    return (found[1] or found[2] or found[3]) + b"-"


def _chat(**extra: Any) -> bytes:
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], **extra}
    return json.dumps(body).encode()


def _post(path: str, body: bytes, *extra: bytes) -> bytes:
    head = [b"POST " + path.encode() + b" HTTP/1.1", b"host: 127.0.0.1"]
    head += [b"content-type: application/json", b"content-length: %d" % len(body), *extra]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


def _split(raw: bytes) -> tuple[bytes, bytes]:
    """A request as its head and its body, to send a moment apart."""
    head, body = raw.split(b"\r\n\r\n", 1)
    return head + b"\r\n\r\n", body


async def _open(h: Harness) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    port = int(h.url.rsplit(":", 1)[1])
    return await asyncio.open_connection("127.0.0.1", port)


async def _exchange(h: Harness, *parts: bytes) -> bytes:
    """Send `parts` (a moment apart) on a fresh connection; everything the server writes until
    it closes."""
    reader, writer = await _open(h)
    for i, part in enumerate(parts):
        if i:
            await asyncio.sleep(0.05)
        writer.write(part)
        await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(-1), 10)
    finally:
        writer.close()


async def _until_seen(reader: asyncio.StreamReader, got: bytearray, needle: bytes) -> None:
    while needle not in got:
        chunk = await asyncio.wait_for(reader.read(65536), 3)
        assert chunk, f"closed before {needle!r}: {bytes(got)!r}"
        got += chunk


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a reset (SO_LINGER 0), as a client killed mid-request does."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


# What the Python listener answered to each case, the clock's fields blanked as `_CLOCK` does.
_RECORDED: dict[str, str] = json.loads(
    (Path(__file__).parent / "front_answers.json").read_text(encoding="utf-8")
)


_SMALL = _chat(max_tokens=2)
_CHUNKED_HEAD = (
    b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
    b"transfer-encoding: chunked\r\nconnection: close\r\n\r\n"
)
_CHUNKED = b"%x\r\n%s\r\n0\r\n\r\n" % (len(_SMALL), _SMALL)
# Each case: what the client sends (parts a moment apart), and the status it is answered with.
_CASES: dict[str, tuple[tuple[bytes, ...], bytes]] = {
    "get": ((b"GET /v1/models HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n",), b"200"),
    "post": ((_post(CHAT, b"{}", b"connection: close"),), b"400"),
    "garbage": ((b"NOT HTTP\r\n\r\n",), b"400"),
    "head_431": ((b"GET / HTTP/1.1\r\nx: " + b"y" * 8000 + b"\r\n\r\n",), b"431"),
    # A head that never ends, growing past the limit (the Python listener counts the reads
    # after the one the request began in)
    "growing_431": ((b"GET / HTTP/1.1\r\n", b"x: y\r\n" * 1100), b"431"),
    "te_and_cl": ((_post(CHAT, b"{}", b"transfer-encoding: chunked"),), b"400"),  # smuggling
    "two_cl": ((_post(CHAT, b"x" * 100, b"content-length: 3000")[:-50],), b"400"),
    "body_413": ((_post(CHAT, b"x" * 3000)[:-2900],), b"413"),  # BodyLimit's, over the limit
    # uvicorn's interim `100 Continue`, then the answer to the body sent after it
    "expect_100": (
        _split(_post(CHAT, b"{}", b"expect: 100-continue", b"connection: close")),
        b"100",
    ),
    "chunked_body": ((_CHUNKED_HEAD, _CHUNKED), b"200"),
    "bad_chunk": ((_CHUNKED_HEAD, b"zz\r\nhello\r\n0\r\n\r\n"), b"400"),
    "timeout_408": ((b"GET /health HTTP/1.1\r\nhost: 127",), b"408"),  # then nothing
}


@pytest.mark.parametrize("case", _CASES.keys())
async def test_answers_are_the_python_listeners_byte_for_byte(case: str) -> None:
    """The app's answers through the front, and those the front writes itself."""
    raw, status = _CASES[case]
    limits = {"max_header_bytes": 6000}
    server = {"max_body_bytes": 2048, "read_timeout_ms": 300}
    python = _CLOCK.sub(_blank, _RECORDED[case].encode("latin-1"))
    assert python.startswith(b"HTTP/1.1 " + status + b" "), python
    async with start_gateway(server=server, limits=limits) as h:
        native = _CLOCK.sub(_blank, await _exchange(h, *raw))
    assert native == python


async def test_a_streamed_reply_goes_out_chunk_by_chunk() -> None:
    async with start_gateway() as h:
        reader, writer = await _open(h)
        writer.write(_post(CHAT, _chat(stream=True, max_tokens=3, fake={"step": True})))
        got = bytearray()
        for i in range(3):
            h.fake.release()
            await _until_seen(reader, got, b"t%d " % i)  # before the next token exists
            assert b"t%d " % (i + 1) not in got
        await _until_seen(reader, got, b"data: [DONE]\n\n\r\n0\r\n\r\n")
        writer.close()


async def test_keep_alive_pipelining_and_http_1_0() -> None:
    async with start_gateway() as h:
        reader, writer = await _open(h)
        models = b"GET /v1/models HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n"
        health = b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n"
        writer.write(_post(CHAT, _chat(max_tokens=2)) + models + health)  # all in one write
        replies = await asyncio.wait_for(reader.read(-1), 10)  # closed after the third
        writer.close()
        starts = [m.start() for m in re.finditer(rb"HTTP/1\.1 \d{3} ", replies)]
        assert len(starts) == 3, replies
        ends = [*starts[1:], None]
        first, second, third = (replies[a:b] for a, b in zip(starts, ends, strict=True))
        assert b"chat.completion" in first, replies
        assert b'"fake-model"' in second, replies
        assert third.endswith(b'{"status":"ok"}'), replies
        old = await _exchange(h, b"GET /health HTTP/1.0\r\n\r\n")  # no keep-alive: closed
        assert old.startswith(b"HTTP/1.1 200 "), old
        assert old.endswith(b'{"status":"ok"}'), old
        assert h.fake.seen == 1


async def test_a_websocket_is_spliced_through() -> None:
    async with start_gateway() as h:
        async with connect(h.url.replace("http://", "ws://") + "/v1/ws") as ws:
            body = json.loads(_chat(max_tokens=3))
            request = {"type": "request", "id": "r", "endpoint": "chat", "body": body}
            await ws.send(json.dumps(request))
            kinds, text = [], ""
            while not kinds or kinds[-1] != "end":
                message = json.loads(await asyncio.wait_for(ws.recv(), 5))
                kinds.append(message["type"])
                for choice in message.get("data", {}).get("choices", ()):
                    text += (choice.get("delta") or {}).get("content") or ""
        assert kinds[0] == "start"
        assert text == "t0 t1 t2 "


async def test_the_client_address_reaches_the_app_and_a_forged_one_does_not() -> None:
    async with start_gateway() as h:

        async def peer(request: Request) -> dict[str, Any]:
            assert request.client is not None
            names = [k for k, _ in request.headers.items()]
            return {"client": [request.client.host, request.client.port], "headers": names}

        h.app.add_api_route("/test/peer", peer)
        reader, writer = await _open(h)
        writer.write(
            b"GET /test/peer HTTP/1.1\r\nhost: 127.0.0.1\r\nx-llmflow-peer: 6.6.6.6:66\r\n"
            b"connection: close\r\n\r\n"
        )
        reply = await asyncio.wait_for(reader.read(-1), 5)
        host, port = writer.get_extra_info("sockname")[:2]
        writer.close()
        seen = json.loads(reply.split(b"\r\n\r\n", 1)[1])
        assert seen["client"] == [host, port]
        assert "x-llmflow-peer" not in seen["headers"]


async def test_a_client_reset_mid_body_or_mid_stream_reaches_the_app() -> None:
    async with start_gateway() as h:
        reader, writer = await _open(h)  # mid-body: the app never gets the whole request
        writer.write(_post(CHAT, _chat(max_tokens=2) + b" " * 100)[:-50])
        await writer.drain()
        await asyncio.sleep(0.1)
        _reset(writer)
        reader, writer = await _open(h)  # mid-stream: vLLM's request is aborted
        writer.write(_post(CHAT, _chat(stream=True, max_tokens=5, fake={"step": True})))
        got = bytearray()
        h.fake.release()
        await _until_seen(reader, got, b"t0 ")
        _reset(writer)
        await until(lambda: h.fake.aborted == 1)
        assert (h.fake.seen, h.fake.completed) == (1, 0)
        await until(lambda: h.fake.running == 0)


@pytest.mark.parametrize(
    ("sent", "client"),
    [(b"[::1]:5001", ("::1", 5001)), (b"10.0.0.7:80", ("10.0.0.7", 80)), (b"junk", None)],
)
async def test_peer_from_front_reads_ipv4_and_ipv6(sent: bytes, client: Any) -> None:
    seen: list[Any] = []

    async def app(scope: Any, _receive: Any, _send: Any) -> None:
        seen.append((scope["client"], scope["headers"]))

    headers = [(b"host", b"x"), (b"x-llmflow-peer", sent)]
    await PeerFromFront(app)({"type": "http", "client": None, "headers": headers}, None, None)  # type: ignore[arg-type]
    assert seen == [(client, [(b"host", b"x")])]
