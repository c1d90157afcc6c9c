"""Hostile inputs (issue 26): what a tenant, a backend, Redis or a metrics page sends to break the
gateway, and the bound that contains it. Each case is read from outside the code under test:
what the backend itself received (its own record of bodies, its own `/metrics`, connections a
listener of ours accepted), the bytes on the client's wire, /proc.

The WebSocket cases are in `test_hostile_ws.py`, the parsers' fuzz targets in
`test_parser_fuzz.py` (and `rust/src/relay/sse.rs`'s proptests). The table of what was tried is
in `docs/reliability.md`.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import re
import socket
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from llmflow.gateway.app import create_app
from llmflow.sim.server_pd import KvTransfer
from tests.gateway.harness import (
    SIM_MODEL,
    serve_asgi,
    serve_gateway,
    settings_for,
    start_gateway,
    start_sim_gateway,
    until,
)

from .hostile import RawBackend, chunk_event, install
from .replies import CHAT, chat
from .wire import exchange, fds_of_self, open_raw, post_bytes, read_until_closed

if TYPE_CHECKING:
    from collections.abc import AsyncIterator
    from pathlib import Path

pytestmark = pytest.mark.anyio
CLOSE = "connection: close\r\n\r\n"


@contextlib.asynccontextmanager
async def listener() -> AsyncIterator[tuple[int, list[int]]]:
    """A TCP port of ours that counts who connects to it: (port, [connections])."""
    accepted = [0]

    async def on_connect(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        accepted[0] += 1
        w.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1], accepted
    finally:
        server.close()
        await server.wait_closed()


async def _sim_metric(h: Any, name: str) -> float:
    """A value from the simulated vLLM's own /metrics (summed over its label sets)."""
    text = (await h.client.get(h.sim_url + "/metrics")).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and not line.startswith("#")
    )


# -- 1. kv_transfer_params are the gateway's to set ------------------------------------------


async def test_a_clients_kv_transfer_params_never_reach_the_backend() -> None:
    """A tenant asking a KV-connector backend to hold its KV after the reply (do_remote_decode)
    or to pull KV from a host it names (do_remote_prefill at our listener): on main the
    simulated vLLM kept the blocks (KV usage > 0 after the reply, the gateway's ledger at 0)
    and connected to the named host. Now the fields are stripped: nothing held, nobody called."""
    kv = {"kv_transfer": KvTransfer(bandwidth_gb_s=50.0, latency_ms=1.0)}
    async with listener() as (port, accepted), start_sim_gateway(sim_options=kv) as h:
        h.sim_url = _sim_url(h)
        pin = {"do_remote_decode": True, "do_remote_prefill": False}
        reach = {
            "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "x",
            "remote_block_ids": [0, 1, 2], "remote_host": "127.0.0.1", "remote_port": port,
        }  # fmt: skip
        body = {"model": SIM_MODEL, "prompt": "word " * 120, "max_tokens": 4}
        for params in (pin, reach):
            for stream in (False, True):
                r = await h.client.post(
                    "/v1/completions",
                    json={**body, "stream": stream, "kv_transfer_params": params},
                    timeout=30,
                )
                assert r.status_code == 200, r.text
                if not stream:
                    assert r.json().get("kv_transfer_params") is None
        await asyncio.sleep(0.2)
        assert await _sim_metric(h, "vllm:kv_cache_usage_perc") == 0  # no block left pinned
        assert accepted == [0]  # the backend never dialled the host the client named


def _sim_url(h: Any) -> str:
    return next(iter(h.gateway.scraper.states.values())).url


async def test_the_decode_hop_carries_only_what_the_prefill_answered() -> None:
    """A split pool whose prefill instance answers no kv_transfer_params (no connector): on
    main the decode hop sent the client's own; now it sends none."""
    async with start_gateway(
        n_backends=2,
        per_backend={"b0": {"role": "prefill"}, "b1": {"role": "decode"}},
        configure=_prefill_answers_json,
    ) as h:
        params = {"do_remote_prefill": True, "remote_host": "10.255.0.1", "remote_port": 9}
        r = await h.client.post(
            CHAT, json=chat(stream=True, max_tokens=3, kv_transfer_params=params)
        )
        assert r.status_code == 200
        prefill, decode = h.fakes["b0"], h.fakes["b1"]
        assert prefill.bodies[-1]["kv_transfer_params"]["do_remote_decode"] is True
        assert "kv_transfer_params" not in decode.bodies[-1]


def _prefill_answers_json(fakes: dict[str, Any]) -> None:
    """The fake streams every reply; a prefill hop (stream false) needs JSON, as vLLM's."""
    fakes["b0"].app = JsonPrefill(fakes["b0"], fakes["b0"].app)


class JsonPrefill:
    """ASGI wrapper: answers an unstreamed completion as vLLM without a KV connector does."""

    def __init__(self, fake: Any, app: Any) -> None:
        self.fake, self.app = fake, app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].endswith("completions"):
            await self.app(scope, receive, send)
            return
        raw = b""
        while True:
            message = await receive()
            raw += message.get("body", b"")
            if not message.get("more_body"):
                break
        body = json.loads(raw)
        if body.get("stream") is not False:
            replayed = False

            async def replay() -> Any:
                nonlocal replayed
                if replayed:
                    return await receive()
                replayed = True
                return {"type": "http.request", "body": raw, "more_body": False}

            await self.app(scope, replay, send)
            return
        self.fake.seen += 1
        self.fake.bodies.append(body)
        answer = json.dumps({"choices": [{"index": 0, "text": "x"}], "kv_transfer_params": None})
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})  # fmt: skip
        await send({"type": "http.response.body", "body": answer.encode()})


# -- 5. priority on the light routes ---------------------------------------------------------


async def test_a_light_request_cannot_set_its_own_priority() -> None:
    seen: list[dict[str, Any]] = []

    def configure(fakes: dict[str, Any]) -> None:
        from starlette.responses import JSONResponse
        from starlette.routing import Route

        async def embeddings(request: Any) -> Any:
            seen.append(await request.json())
            return JSONResponse({"object": "list", "data": []})

        fakes["b0"].app.router.routes.append(Route("/v1/embeddings", embeddings, methods=["POST"]))

    async with start_gateway(configure=configure, backend={"scheduling_policy": "priority"}) as h:
        body = {"model": "fake-model", "input": "x", "priority": -1000, "kv_transfer_params": {}}
        r = await h.client.post("/v1/embeddings", json=body)
        assert r.status_code == 200, r.text
        assert seen == [{"model": "fake-model", "input": "x"}]


# -- 10. a keyless gateway answers only its own Host and Origin ------------------------------


async def test_a_keyless_gateway_refuses_rebinding_and_cross_site_posts() -> None:
    async with start_gateway() as h:
        # DNS rebinding: the attacker's name resolves to us, so the page's Host is its own
        for path in ("/api/state", "/v1/models"):
            raw = f"GET {path} HTTP/1.1\r\nhost: rebind.evil.example:8080\r\n{CLOSE}"
            reply = await exchange(h.url, raw.encode())
            assert reply.startswith(b"HTTP/1.1 403"), reply[:200]
            assert b'"core"' not in reply
        # a cross-site "simple" POST (text/plain, no preflight)
        body = json.dumps(chat(stream=False, max_tokens=2)).encode()
        for origin in ("https://evil.example", "null"):
            raw = post_bytes(CHAT, body, f"origin: {origin}\r\nconnection: close\r\n")
            raw = raw.replace(b"application/json", b"text/plain")
            reply = await exchange(h.url, raw)
            assert reply.startswith(b"HTTP/1.1 403"), reply[:200]
            assert b"forbidden_origin" in reply
        assert h.fake.seen == 0  # nothing reached the backend
        # same-origin pages and tools are served
        own = h.url
        r = await h.client.post(
            CHAT, json=chat(stream=False, max_tokens=2), headers={"origin": own}
        )
        assert r.status_code == 200
        async with httpx.AsyncClient(base_url=h.url.replace("127.0.0.1", "localhost")) as c:
            assert (await c.get("/v1/models")).status_code == 200
        assert h.fake.seen == 1


async def test_a_gateway_with_keys_serves_any_host() -> None:
    tenants = [{"name": "t", "tier": "normal", "api_keys": ["k-any-host-0123"]}]
    async with start_gateway(tenants=tenants) as h:
        raw = "GET /v1/models HTTP/1.1\r\nhost: llmflow.internal\r\n"
        raw += f"authorization: Bearer k-any-host-0123\r\n{CLOSE}"
        assert (await exchange(h.url, raw.encode())).startswith(b"HTTP/1.1 200")


# -- 2. a bad scrape is that scrape's, never the loop's --------------------------------------


async def test_nan_negative_and_huge_metrics_never_stop_the_scrape_loop() -> None:
    """On main the first NaN (or -1, or 2^64) raised out of the scrape loop: the fake's own
    count of /metrics requests stopped growing and the backend's health froze. Now each bad
    value is dropped and the loop goes on: the fake keeps being scraped, and a backend taken
    down meanwhile comes back."""
    async with start_gateway() as h:
        fake = h.fake
        for kv, preemptions in ((float("nan"), 0), (0.1, -1), (float("inf"), 2**64), (2.0, 0)):
            fake.kv_usage, fake.preemptions = kv, preemptions
            before = fake.metrics_scrapes
            await until(lambda b=before: fake.metrics_scrapes >= b + 3, 3.0)
        fake.metrics_status = 503  # now it goes away: the runtime marks it down ...
        await until(lambda: not _healthy(h), 5.0)
        fake.kv_usage, fake.preemptions, fake.metrics_status = 0.0, 0, 200
        await until(lambda: _healthy(h), 5.0)  # ... and back up: the loop still runs
        r = await h.client.post(CHAT, json=chat(stream=False, max_tokens=2))
        assert r.status_code == 200
        state = (await h.client.get("/api/state")).json()
        assert state["backends"]["b0"]["scrape_age_s"] < 1.0


def _healthy(h: Any) -> bool:
    return all(s.healthy for s in h.gateway.scraper.states.values())


# -- 6. a bad record in Redis is that record's -----------------------------------------------


async def test_garbage_in_the_shared_redis_hashes_and_scrape_record_is_contained(
    redis_server: Any,
) -> None:
    """One string where a number goes in each shared hash, and a scrape record that is not
    JSON: on main every sync failed (Redis taken as lost, fail_closed: every request a 503)
    and the bad field stayed. Now requests are served, the fields are purged (read back
    from Redis by our own client) and the scrape record is replaced by a sound one."""
    import redis.asyncio as aioredis

    r = aioredis.from_url(redis_server.url)
    try:
        for key in ("service", "used-requests", "used-tokens"):
            await r.hset(f"llmflow:{key}", mapping={"anonymous": "garbage", "other": "nan"})
        await r.hset("llmflow:waiting-weight", mapping={"ghost": "not-a-weight"})
        await r.set("llmflow:scrape:b0", b"\xff{not json")
        state = {"backend": "redis", "url": redis_server.url, "sync_interval_ms": 50}
        async with start_gateway(state=state, gate={"queue": {"max_wait_ms": 2000}}) as h:
            replies = [
                await h.client.post(CHAT, json=chat(stream=False, max_tokens=2)) for _ in range(3)
            ]
            assert [x.status_code for x in replies] == [200, 200, 200], replies[-1].text
            assert h.fake.seen == 3
            await asyncio.sleep(0.3)  # a few syncs
            for key in ("service", "used-requests", "used-tokens"):
                values = await r.hgetall(f"llmflow:{key}")
                assert b"other" not in values
                assert float(values.get(b"anonymous", b"0")) >= 0
            assert await r.hget("llmflow:waiting-weight", "ghost") is None
            record = json.loads(await r.get("llmflow:scrape:b0") or b"{}")
            assert "values" in record
    finally:
        await r.aclose()


# -- 4. an SSE event without end is bounded --------------------------------------------------

EVENT_LIMIT = 1 << 20  # server.max_event_bytes in these cases
HUGE_EVENT = 48 << 20  # what the backend sends without ever ending the event


def _peak_rss_reset() -> int:
    """Reset this process's peak RSS (VmHWM) to its current RSS; return that RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kb("VmRSS") * 1024


def _peak_rss() -> int:
    return _status_kb("VmHWM") * 1024


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(field)


async def _endless_event(_body: dict[str, Any]) -> AsyncIterator[bytes]:
    yield chunk_event("first ")
    yield b'data: {"id":"x","choices":[{"index":0,"delta":{"content":"'
    piece = b"x" * 65536
    for _ in range(HUGE_EVENT // len(piece)):
        yield piece


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "unstreamed"])
async def test_an_sse_event_that_never_ends_is_bounded(stream: bool) -> None:
    """A backend sends 48 MiB of one event with no end. On main it was all buffered and
    rescanned from its start on every read (the relay's thread stalled; RSS grew by the
    event). Now the stream fails with a 502 once the event passes server.max_event_bytes
    (1 MiB here): this process's peak RSS (gateway, backend and client together, from /proc)
    grows by a few MiB, and the next request is served."""
    server = {"max_event_bytes": EVENT_LIMIT}
    async with start_gateway(configure=install, server=server) as h:
        backend = h.fake.app
        backend.script = _endless_event
        gc.collect()
        before = _peak_rss_reset()
        r = await h.client.post(CHAT, json=chat(stream=stream, max_tokens=5), timeout=20)
        growth = _peak_rss() - before
        if stream:
            assert r.status_code == 200  # the first token was out: the error comes in-band
            assert b'"error"' in r.content, r.content[-300:]
            assert not r.content.rstrip().endswith(b"data: [DONE]") or b"error" in r.content
        else:
            assert r.status_code == 502, r.text
        assert growth < 12 * EVENT_LIMIT, f"peak RSS grew by {growth / 2**20:.1f} MiB"
        backend.script = None
        ok = await h.client.post(CHAT, json=chat(stream=stream, max_tokens=3))
        assert ok.status_code == 200
        assert _healthy(h)  # the backend is not taken down for one bad event


# -- 13. a CRLF split between reads ends its event -------------------------------------------


async def test_a_crlf_split_between_reads_never_merges_two_events() -> None:
    """On main the Python path normalised CRLF per read, so `...\\r\\n\\r` + `\\n` left a `\\r`
    between the two newlines and the event ran on into the next: two chunks joined into one
    payload that is not JSON (a 502), or text lost."""

    async def split(_body: dict[str, Any]) -> AsyncIterator[bytes]:
        for word in ("one ", "two ", "three "):
            event = chunk_event(word).replace(b"\n\n", b"\r\n\r\n")
            yield event[:-1]  # ...\r\n\r  |  \n
            await asyncio.sleep(0.02)  # its own read
            yield event[-1:]
            await asyncio.sleep(0.02)
        yield b"data: [DONE]\r\n\r\n"

    async with start_gateway(configure=install) as h:
        h.fake.app.script = split
        r = await h.client.post(CHAT, json=chat(stream=False, max_tokens=5))
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == "one two three "


# -- 7. HTTP/1.1 pipelining ------------------------------------------------------------------


def _responses(raw: bytes) -> list[bytes]:
    """The status lines of the responses in `raw`, in order."""
    return re.findall(rb"HTTP/1\.1 \d{3} [A-Za-z ]*(?=\r\n)", raw)


async def test_a_request_pipelined_behind_a_relayed_stream_is_answered_after_it() -> None:
    """Two streamed completions in one write. On main the first (relayed) became a plain-text
    500 and the second was never answered; now both stream in order on the connection,
    each to its [DONE], and the backend served each once."""
    async with start_gateway() as h:
        one = post_bytes(CHAT, chat(max_tokens=20, fake={"itl": 0.005}))
        two = post_bytes(CHAT, chat(max_tokens=3))
        reply = await exchange(h.url, one + two, timeout_s=3)
        assert _responses(reply) == [b"HTTP/1.1 200 OK", b"HTTP/1.1 200 OK"], reply[:400]
        assert reply.count(b"data: [DONE]") == 2
        first, second = reply.split(b"HTTP/1.1 200 OK")[1:]
        assert first.count(b'"content"') >= 20
        assert second.count(b'"content"') >= 3
        assert h.fake.seen == 2
        assert h.fake.completed == 2


async def test_pipelined_requests_of_small_heads_are_not_refused_as_one_big_head() -> None:
    """12 pipelined GETs with 3 KiB of headers each, and the start of a 13th, in one write
    (38 KiB, over the 32 KiB head limit), the 13th's end a moment later. On main the whole
    read counted as the 13th's head: a spurious 431 for a 3 KiB head."""
    pad = "x" * 3000
    one = f"GET /v1/models HTTP/1.1\r\nhost: localhost\r\nx-pad: {pad}\r\n\r\n".encode()
    async with start_gateway() as h:
        reader, writer = await open_raw(h.url)
        try:
            writer.write(one * 12 + one[:2000])
            await writer.drain()
            await asyncio.sleep(0.2)
            writer.write(one[2000:])
            await writer.drain()
            reply = await read_until_closed(reader, 1.5)
        finally:
            writer.close()
        assert _responses(reply) == [b"HTTP/1.1 200 OK"] * 13, _responses(reply)[:3]


async def test_pipeline_depth_is_bounded() -> None:
    """5,000 requests pipelined in one go: on main every one was queued (RSS grew with
    them). Now at most MAX_PIPELINE wait behind the one answered; those are answered, in
    order, then the connection closes and the rest were never read."""
    from llmflow.gateway.guard import MAX_PIPELINE

    one = b"GET /v1/models HTTP/1.1\r\nhost: localhost\r\n\r\n"
    async with start_gateway() as h:
        reply = await exchange(h.url, one * 5000, timeout_s=3)
        answered = _responses(reply)
        assert set(answered) == {b"HTTP/1.1 200 OK"}
        assert len(answered) <= MAX_PIPELINE + 1 + 256 * 1024 // len(one), len(answered)
        assert len(answered) < 5000
        r = await h.client.get("/v1/models")  # others are served throughout
        assert r.status_code == 200


# -- 8. JSON of the wrong shape is a failure, never a clean end ------------------------------

WRONG_SHAPES = (
    b'data: {"choices": 5}\n\n',
    b'data: {"choices": [{"index": 0, "delta": "two "}]}\n\n',
    b'data: {"choices": [], "usage": "lots"}\n\n',
    b"data: [1, 2, 3]\n\n",
)


@pytest.mark.parametrize("bad", WRONG_SHAPES, ids=["choices-int", "delta-str", "usage-str", "list"])
@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "unstreamed"])
async def test_a_chunk_of_the_wrong_shape_fails_the_reply(stream: bool, bad: bytes) -> None:
    """On main such a chunk raised outside the caught errors (Python path: the client got a
    clean [DONE], or a 200 with part of the text) or was skipped (the relay). Now the reply
    fails visibly: an in-band error once streaming, a 502 before."""

    async def reply(_body: dict[str, Any]) -> AsyncIterator[bytes]:
        yield chunk_event("one ")
        yield bad
        yield chunk_event("three ")
        yield b"data: [DONE]\n\n"

    async with start_gateway(configure=install) as h:
        h.fake.app.script = reply
        r = await h.client.post(CHAT, json=chat(stream=stream, max_tokens=5))
        if stream:
            assert r.status_code == 200
            assert b'"error"' in r.content, r.content[-300:]
            assert b"backend sent" in r.content
        else:
            assert r.status_code == 502, r.text
            assert "backend sent" in r.json()["error"]["message"]
        assert _healthy(h)  # one bad reply: the backend stays up


# -- 11. a client that never reads gives its fd back ------------------------------------------


async def test_a_client_that_never_reads_gives_back_its_fd_and_buffer() -> None:
    """Three clients ask for 48 MB streams and never read a byte, nor close. The stall
    timer cuts them; on main the Python path's socket then waited for a flush that never
    came, holding its fd (and the buffered reply) as long as the client stayed. Now the
    gateway's side of each is gone within a second of the cut: this process's fd count in
    /proc is back to the baseline plus the clients' own three."""
    backpressure = {"client_window": 4, "stall_timeout_ms": 500}
    async with start_gateway(backpressure=backpressure) as h:
        await h.client.get("/v1/models")  # the test client's own connection is open
        baseline = fds_of_self()
        socks = []
        body = chat(max_tokens=3000, fake={"chunk_bytes": 16384})
        for _ in range(3):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(tuple_of(h.url))
            sock.sendall(post_bytes(CHAT, body))
            socks.append(sock)
        try:
            await until(lambda: h.fake.aborted == 3, timeout_s=10)  # cut for the stall
            await until(lambda: fds_of_self() <= baseline + 3, timeout_s=3.0)
        finally:
            for sock in socks:
                sock.close()


def tuple_of(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


# -- 13. HTTP/1.1 framing from a backend, and the pooled POST --------------------------------


@contextlib.asynccontextmanager
async def raw_gateway(**sections: Any) -> AsyncIterator[tuple[Any, RawBackend]]:
    backend = RawBackend()
    url = await backend.start()
    settings = settings_for({"raw": url}, **sections)
    app = create_app(settings)
    try:
        async with (
            serve_gateway(app) as gw_url,
            httpx.AsyncClient(base_url=gw_url, timeout=10) as client,
        ):
            yield client, backend
    finally:
        await backend.stop()


def _chunked_sse(size_format: bytes) -> bytes:
    body = chunk_event("ok ") + b"data: [DONE]\n\n"
    head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    return head + (size_format % len(body)) + b"\r\n" + body + b"\r\n0\r\n\r\n"


@pytest.mark.parametrize(
    "reply",
    [
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n-5\r\nhello\r\n0\r\n\r\n",
        _chunked_sse(b"0x%x"),  # a well-formed stream, but sizes as Python's int() reads them
        _chunked_sse(b"+%x"),
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + b"f" * 5000,
        b"HTTP/1.1 200 OK\r\ncontent-length: -5\r\n\r\ndata: [DONE]\n\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\ncontent-length: 50\r\n\r\ndata: [DONE]\n\n",
    ],
    ids=["negative-chunk", "0x-chunk", "plus-chunk", "endless-size-line", "negative-cl", "two-cl"],
)
async def test_lenient_framing_from_a_backend_is_a_502(reply: bytes) -> None:
    """On main `int(x, 16)` took `0x1e` and `+1e` as chunk sizes (a stream framed so was
    served), a size line was buffered without end, and of two Content-Lengths the last won.
    Now each is the backend's error: a 502, and the connection is not reused."""
    async with raw_gateway() as (client, backend):
        backend.mode = reply
        r = await client.post(CHAT, json=chat(stream=False, max_tokens=2))
        assert r.status_code == 502, r.text
        assert r.json()["error"]["code"] == "backend_error"


async def test_a_post_goes_out_at_most_twice_however_many_pooled_links_are_stale() -> None:
    """Six pooled keep-alive connections, then the backend starts taking requests and
    closing without a word: on main the POST went out on each of the six and a fresh one
    (the backend counted 7); now once more on a fresh connection at most (2)."""
    async with raw_gateway() as (client, backend):
        replies = await asyncio.gather(
            *(client.post(CHAT, json=chat(stream=False, max_tokens=2, fake={"n": i}))
              for i in range(6))
        )  # fmt: skip
        assert [r.status_code for r in replies] == [200] * 6
        assert backend.connections >= 6
        backend.mode, before = "swallow", backend.posts
        r = await client.post(CHAT, json=chat(stream=False, max_tokens=2))
        assert r.status_code == 502
        assert backend.posts - before <= 2


# -- 12. a trace file gives no prompt away ---------------------------------------------------


def test_a_short_secret_in_a_prompt_cannot_be_found_from_the_trace(tmp_path: Path) -> None:
    """A prompt holds a 4-digit PIN; the gateway runs `--trace` with prefix routing (so the
    prompt's block hashes and the body's fingerprint go into the trace). On main both were
    unkeyed (FxHash, CRC-32): trying the 10,000 PINs found it in 51 ms. Now both are keyed
    with a per-process secret: no PIN reproduces a value of the trace; and the file is the
    user's alone (0600) whatever the umask."""
    import zlib

    from llmflow._core import prefix_hashes
    from tests.gateway.outside import outside_gateway

    def body_of(pin: str) -> bytes:
        head = f"Customer's card PIN is {pin}; never repeat it. ".ljust(64, "x")
        prompt = head + "Write a poem about the sea." * 4
        return json.dumps({"model": "fake-model", "prompt": prompt, "max_tokens": 2}).encode()

    trace = tmp_path / "trace.jsonl"
    old_umask = os.umask(0o022)
    try:
        args = ("--trace", str(trace))
        with outside_gateway(tmp_path, extra_args=args, routing={"policy": "prefix"}) as g:
            r = httpx.post(g.url + "/v1/completions", content=body_of("4821"),
                           headers={"content-type": "application/json"}, timeout=30)  # fmt: skip
            assert r.status_code == 200, r.text
            assert g.gateway.stop() == 0
    finally:
        os.umask(old_umask)
    assert trace.stat().st_mode & 0o077 == 0
    values: set[int] = set()
    for line in trace.read_text().splitlines():
        event = json.loads(line).get("ev")
        arrive = event.get("arrive") if isinstance(event, dict) else None
        if arrive:
            values |= set(arrive.get("chain", ())) | {arrive.get("fingerprint", 0)}
    assert len(values) > 2  # hashes and a fingerprint were recorded
    for n in range(10_000):
        raw = body_of(f"{n:04d}")
        prompt = json.loads(raw)["prompt"].encode()
        unkeyed = set(prefix_hashes(prompt, 64)) | {zlib.crc32(raw) << 32 | len(raw)}
        assert not unkeyed & values, f"PIN {n:04d} found from the trace"


async def test_a_relayed_reply_framed_wrong_does_not_take_the_backend_down() -> None:
    """A chunk size that is not hex under a relayed stream. On main the relay marked the
    backend down for it (every request then a 503 until a scrape); now it is this reply's
    502, and the next request is served by the same backend."""
    bad = chunk_event("one ")
    reply = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
        b"\r\n%x\r\n%s\r\nzz\r\n" % (len(bad), bad)
    )
    async with raw_gateway() as (client, backend):
        backend.mode = reply
        r = await client.post(CHAT, json=chat(max_tokens=2))
        assert r.status_code == 200
        assert b'"error"' in r.content, r.content[-200:]
        backend.mode = "ok"
        again = await client.post(CHAT, json=chat(max_tokens=2))
        assert again.status_code == 200, again.text
        assert b"ok " in again.content


async def test_a_502_names_no_address_of_the_backend() -> None:
    """A backend that stops listening between two requests (no scrape in between): on main
    the Python path's 502 quoted the exception, with the backend's address and port."""
    async with raw_gateway(metrics={"scrape_interval_ms": 60_000}) as (client, backend):
        assert (await client.post(CHAT, json=chat(stream=False, max_tokens=2))).status_code == 200
        port = backend.server.sockets[0].getsockname()[1]
        await backend.stop()
        await asyncio.sleep(0.05)
        r = await client.post(CHAT, json=chat(stream=False, max_tokens=2))
        assert r.status_code == 502, r.text
        assert r.json()["error"]["code"] == "backend_unavailable"
        assert "127.0.0.1" not in r.text, r.text
        assert str(port) not in r.text


async def test_responses_force_store_off_and_resolve_aliases() -> None:
    """On main `store` was stripped (vLLM's default then applied) and an alias went upstream
    as the alias. Now vLLM gets `store: false` and the served model's name."""
    seen: list[dict[str, Any]] = []

    def configure(fakes: dict[str, Any]) -> None:
        from starlette.responses import JSONResponse
        from starlette.routing import Route

        async def responses(request: Any) -> Any:
            seen.append(await request.json())
            return JSONResponse({"error": {"message": "enough", "type": "x", "code": 400}}, 400)

        fakes["b0"].app.router.routes.append(Route("/v1/responses", responses, methods=["POST"]))

    async with start_gateway(configure=configure, models={"fast": "fake-model"}) as h:
        for store in (True, None):
            body = {"model": "fast", "input": "hi", "max_output_tokens": 4}
            if store is not None:
                body["store"] = store
            await h.client.post("/v1/responses", json=body)
        assert [(b["model"], b["store"]) for b in seen] == [("fake-model", False)] * 2


def test_two_replicas_on_one_host_and_pid_get_different_ids(redis_server: Any) -> None:
    """Containers are all pid 1 and a copied pod may share a hostname: on main two such
    replicas had one id, so their leases and waiting weights were counted as one's."""
    from llmflow.config import load_settings
    from llmflow.gateway.shared_state import SharedSlots

    settings = load_settings(data={"state": {"backend": "redis", "url": redis_server.url}})

    class NoHost:
        runtime: Any = None

    first, second = SharedSlots(settings, NoHost()), SharedSlots(settings, NoHost())  # type: ignore[arg-type]
    assert first.replica != second.replica


async def test_the_schema_moves_off_the_main_port_with_the_admin_routes() -> None:
    """On main `/openapi.json` stayed open on the main port when `admin.port` moved the
    admin routes (and their key) away."""
    from llmflow.gateway.app import create_admin_app

    key = "admin-key-0123456789abcdef"
    async with start_gateway(admin={"port": 0, "api_key": key}) as h:
        assert (await h.client.get("/openapi.json")).status_code == 404
        async with (
            serve_asgi(create_admin_app(h.app)) as (url, _),
            httpx.AsyncClient(base_url=url) as admin,
        ):
            assert (await admin.get("/openapi.json")).status_code == 401
            schema = await admin.get("/openapi.json", headers={"authorization": f"Bearer {key}"})
            assert "/v1/chat/completions" in schema.json()["paths"]


async def test_a_light_client_that_never_reads_gives_its_slot_back() -> None:
    """An embeddings reply of 8 MB to a client that never reads, with one light slot. On
    main the slot was held as long as the client stayed (every other embeddings request a
    429); now the connection is aborted at its write deadline (server.write_timeout_ms),
    the slot given back and the next request served."""

    def configure(fakes: dict[str, Any]) -> None:
        from starlette.responses import Response
        from starlette.routing import Route

        big = json.dumps({"object": "list", "data": [{"embedding": [0.5] * 1_000_000}]})

        async def embeddings(_request: Any) -> Any:
            return Response(big, media_type="application/json")

        fakes["b0"].app.router.routes.append(Route("/v1/embeddings", embeddings, methods=["POST"]))

    async with start_gateway(
        configure=configure,
        backend={"light_concurrency": 1},
        server={"write_timeout_ms": 300},
    ) as h:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(tuple_of(h.url))
        try:
            sock.sendall(post_bytes("/v1/embeddings", {"model": "fake-model", "input": "x"}))
            await asyncio.sleep(0.1)
            body = {"model": "fake-model", "input": "y"}
            loop = asyncio.get_running_loop()
            start = loop.time()
            while (r := await h.client.post("/v1/embeddings", json=body)).status_code == 429:
                assert loop.time() - start < 3, "the slot never came back"
                await asyncio.sleep(0.1)
            assert r.status_code == 200
        finally:
            sock.close()


async def test_a_tenants_rate_limit_holds_on_the_light_routes() -> None:
    """A tenant limited to 2 requests/s sends 10 embeddings at once. On main the light
    routes applied no rate limit (all 10 reached the backend); now 2 do, the other 8 get
    429 `rate_limited` with a Retry-After, and another tenant is not held back."""
    seen: list[str] = []

    def configure(fakes: dict[str, Any]) -> None:
        from starlette.responses import JSONResponse
        from starlette.routing import Route

        async def embeddings(request: Any) -> Any:
            seen.append((await request.json())["input"])
            return JSONResponse({"object": "list", "data": []})

        fakes["b0"].app.router.routes.append(Route("/v1/embeddings", embeddings, methods=["POST"]))

    tenants = [
        {"name": "slow", "tier": "normal", "api_keys": ["k-slow-0123456789"], "requests_per_s": 2},
        {"name": "free", "tier": "normal", "api_keys": ["k-free-0123456789"]},
    ]
    async with start_gateway(configure=configure, tenants=tenants) as h:

        async def embed(key: str, text: str) -> httpx.Response:
            body = {"model": "fake-model", "input": text}
            return await h.client.post(
                "/v1/embeddings", json=body, headers={"authorization": f"Bearer {key}"}
            )

        replies = await asyncio.gather(*(embed("k-slow-0123456789", f"s{i}") for i in range(10)))
        codes = sorted(r.status_code for r in replies)
        assert codes == [200] * 2 + [429] * 8, codes
        refused = [r for r in replies if r.status_code == 429]
        assert {r.json()["error"]["code"] for r in refused} == {"rate_limited"}
        assert all(int(r.headers["retry-after"]) >= 1 for r in refused)
        others = await asyncio.gather(*(embed("k-free-0123456789", f"f{i}") for i in range(5)))
        assert [r.status_code for r in others] == [200] * 5
        assert sorted(x[0] for x in seen) == ["f"] * 5 + ["s"] * 2  # what the backend saw
