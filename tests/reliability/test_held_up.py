"""What held up when issue 26's review attacked the gateway, kept holding: each case tried again
from outside (what the backend received, the bytes on the wire, the backend's own counts).

The ten cases: tier from the key alone; no auth or hop-by-hop headers reach vLLM; every key is
compared every time; the admin port's separation; CL/TE smuggling; the body size limit; the
JSON limits; slowloris; a reset during the hand-off; an upstream that never finishes its head.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import socket
import struct
from typing import Any

import pytest

from llmflow.gateway.app import create_admin_app
from tests.gateway.harness import serve_asgi, start_gateway, until

from .hostile import install
from .replies import CHAT, chat
from .wire import exchange, post_bytes

pytestmark = pytest.mark.anyio

TENANTS = [
    {"name": "gold", "tier": "vip", "api_keys": ["k-gold-0123456789"]},
    {"name": "bulk", "tier": "batch", "api_keys": ["k-bulk-0123456789"]},
]


def _auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def test_the_tier_comes_from_the_key_alone() -> None:
    """A batch key claiming VIP every way a client could (headers, body fields) goes to a
    priority-scheduling backend with the batch tier's priority, not VIP's."""
    backend = {"scheduling_policy": "priority"}
    async with start_gateway(tenants=TENANTS, backend=backend) as h:
        for key, extra, headers in (
            ("k-gold-0123456789", {}, {}),
            ("k-bulk-0123456789", {}, {}),
            ("k-bulk-0123456789", {"priority": -10_000, "tier": "vip", "user": "gold"},
             {"x-user-tier": "vip", "x-llmflow-tier": "vip", "x-tenant": "gold"}),
        ):  # fmt: skip
            body = chat(stream=False, max_tokens=2, **extra)
            r = await h.client.post(CHAT, json=body, headers={**_auth(key), **headers})
            assert r.status_code == 200, r.text
        gold, bulk, claimed = (b["priority"] for b in h.fake.bodies[-3:])
        assert claimed == bulk != gold


async def test_no_auth_or_hop_by_hop_header_reaches_vllm() -> None:
    hop = {
        "connection": "keep-alive, x-secret",
        "x-secret": "s3",
        "te": "trailers",
        "upgrade": "h2c",
        "proxy-authorization": "Basic eDp5",
        "cookie": "session=abc",
        "keep-alive": "timeout=5",
    }
    async with start_gateway(configure=install, tenants=TENANTS) as h:
        for stream in (True, False):
            r = await h.client.post(
                CHAT,
                json=chat(stream=stream, max_tokens=2),
                headers={**_auth("k-gold-0123456789"), **hop},
            )
            assert r.status_code == 200
        for sent in h.fake.app.headers:
            leaked = {"authorization", *hop} & sent.keys() - {"connection"}
            assert not leaked, sent
            assert "x-secret" not in sent.get("connection", "")
            assert "k-gold" not in json.dumps(sent)


async def test_every_key_is_compared_every_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """The lookup's work does not depend on which key matched, or how much of a guess did:
    every configured key's digest is compared, whatever is presented."""
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def counting(a: Any, b: Any) -> bool:
        calls.append((a, b))
        return real(a, b)

    async with start_gateway(tenants=TENANTS) as h:
        monkeypatch.setattr(hmac, "compare_digest", counting)
        for key in ("k-gold-0123456789", "k-bulk-0123456789", "k-gold-0123456780", "x"):
            calls.clear()
            await h.client.get("/v1/models", headers=_auth(key))
            assert len(calls) == len(TENANTS)
            assert len({len(a) for a, _ in calls} | {len(b) for _, b in calls}) == 1  # digests


async def test_the_admin_port_is_separate() -> None:
    admin = {"port": 0, "api_key": "admin-key-0123456789abcdef"}
    async with start_gateway(admin=admin) as h:
        for path in ("/api/state", "/metrics", "/dashboard"):
            assert (await h.client.get(path)).status_code == 404  # not on the main port
        async with serve_asgi(create_admin_app(h.app)) as (url, _):
            for path in ("/api/state", "/metrics", "/dashboard"):
                raw = f"GET {path} HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n"
                assert (await exchange(url, raw.encode())).startswith(b"HTTP/1.1 401")
                raw = raw.replace(
                    "\r\n\r\n", f"\r\nauthorization: Bearer {admin['api_key']}\r\n\r\n"
                )
                assert (await exchange(url, raw.encode())).startswith(b"HTTP/1.1 200")


@pytest.mark.parametrize(
    "framing",
    [
        "content-length: 4\r\ntransfer-encoding: chunked\r\n",
        "transfer-encoding: chunked\r\ncontent-length: 4\r\n",
        "content-length: 4\r\ncontent-length: 40\r\n",
        "transfer-encoding: chunked, identity\r\n",
        "transfer-encoding: xchunked\r\n",
    ],
    ids=["cl-te", "te-cl", "cl-cl", "te-list", "te-bogus"],
)
async def test_cl_te_smuggling_never_reaches_the_backend(framing: str) -> None:
    """A request framed two ways, with a second request smuggled in its body: answered 400
    (or as one request), and the smuggled one never runs upstream."""
    body = json.dumps(chat(stream=False, max_tokens=1)).encode()
    smuggled = post_bytes(CHAT, chat(stream=False, max_tokens=1, smuggled=True))
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    raw = (
        (
            f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n{framing}"
            "content-type: application/json\r\n\r\n"
        ).encode()
        + chunked
        + smuggled
    )
    async with start_gateway() as h:
        reply = await exchange(h.url, raw, timeout_s=1.5)
        assert reply.startswith((b"HTTP/1.1 400", b"HTTP/1.1 200", b"HTTP/1.1 422")), reply[:100]
        assert all(not b.get("smuggled") for b in h.fake.bodies)


async def test_a_body_over_the_limit_is_413_before_it_is_read() -> None:
    async with start_gateway(server={"max_body_bytes": 64 * 1024}) as h:
        head = (
            "POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
            f"content-type: application/json\r\ncontent-length: {50 << 20}\r\n\r\n"
        )
        reply = await exchange(h.url, head.encode() + b"{" * 4096, timeout_s=3)
        assert reply.startswith(b"HTTP/1.1 413"), reply[:100]
        assert h.fake.seen == 0


@pytest.mark.parametrize(
    "body",
    [b"[" * 100_000, b'{"model": "fake-model", "model": "x", "messages": []}', b'{"a": 1e999999}'],
    ids=["deep", "duplicate-key", "huge-number"],
)
async def test_the_json_limits_hold(body: bytes) -> None:
    async with start_gateway() as h:
        r = await h.client.post(CHAT, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"]
        assert h.fake.seen == 0


async def test_slowloris_is_cut_at_the_read_timeout() -> None:
    async with start_gateway(server={"read_timeout_ms": 400}) as h:
        reader, writer = await asyncio.open_connection(*h.url.removeprefix("http://").split(":"))
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n")
        loop = asyncio.get_running_loop()
        start, reply = loop.time(), b""
        while loop.time() - start < 3:  # a header byte every 0.1 s, for ever
            writer.write(b"x")
            try:
                piece = await asyncio.wait_for(reader.read(4096), 0.1)
            except TimeoutError:
                continue
            if not piece:
                break
            reply += piece
        writer.close()
        assert reply.startswith(b"HTTP/1.1 408"), reply[:100]
        assert loop.time() - start < 2.0
        assert h.fake.seen == 0


async def test_a_reset_during_the_hand_off_frees_everything() -> None:
    """A client resets its connection the moment the first token is ready (the relay is
    taking the socket): the backend's request is aborted and nothing stays held."""
    async with start_gateway() as h:
        for _ in range(5):
            sock = socket.create_connection(_addr(h.url))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.sendall(post_bytes(CHAT, chat(max_tokens=500, fake={"ttft": 0.05, "itl": 0.01})))
            await until(lambda: h.fake.running == 1)
            await asyncio.sleep(0.05)  # the first token is out: the hand-off
            sock.close()  # RST
            await until(lambda: h.fake.running == 0)
        assert h.fake.aborted == 5
        r = await h.client.post(CHAT, json=chat(stream=False, max_tokens=2))
        assert r.status_code == 200


async def test_an_upstream_that_never_finishes_its_head_is_given_up() -> None:
    """A backend that accepts the request and never sends its headers: the first-token
    deadline answers the client and the connection upstream is closed (the backend sees
    the disconnect), freeing the slot."""
    completions: list[int] = [0, 0]  # completions received, of them closed by the gateway

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            # A client may connect and leave before writing (a scrape cancelled at shutdown).
            writer.close()
            return
        if request.startswith(b"GET /metrics"):
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-length: 30\r\n\r\nvllm:num_requests_running 0.0\n"
            )
            await writer.drain()
            await reader.read()
            writer.close()
            return
        completions[0] += 1
        await reader.read()  # never answer a completion; wait for the gateway to leave
        completions[1] += 1
        writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    from llmflow.gateway.app import create_app
    from tests.gateway.harness import serve_gateway, settings_for

    settings = settings_for(
        {"mute": f"http://127.0.0.1:{port}"},
        streaming={"first_token_timeout_ms": 300, "on_first_token_timeout": "error"},
    )
    app = create_app(settings)
    try:
        async with serve_gateway(app) as url:
            import httpx

            async with httpx.AsyncClient(base_url=url, timeout=10) as c:
                r = await c.post(CHAT, json=chat(stream=False, max_tokens=2))
                assert r.status_code == 504, r.text
                state = (await c.get("/api/state")).json()["core"]
                assert (state["running"], state["queued"]) == (0, 0)
            assert completions[0] == 1
            await until(lambda: completions[1] == 1, timeout_s=3)  # the backend saw it go
    finally:
        server.close()


def _addr(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)
