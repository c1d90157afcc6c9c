"""A flood's refusals, answered by the front door, are the refusals the Python path answers.

Two gateways, built alike over two fakes, take the same requests: one as `llmflow serve` runs
it (the front serves the streamed completions natively), the other the app alone (as the front
passes it a request it declines, which the app serves through Python). Each app is
wrapped in a counter of the HTTP requests that reach it, so a test sees from outside which way
a request went. Compared: the status line, every header but `date` and `x-request-id` (the
native path numbers its requests from its own range), the body byte for byte, and the
runtime's trace line for each arrival (its time, its timers' and the request ids aside).
Each is also held to its golden, the Python path's answer recorded (`goldens`), which is the
reference alone once the Python path is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from llmflow._core import replay_trace
from llmflow.gateway.app import Gateway, create_app

from .both_paths import paths
from .fake_vllm import FakeVllm
from .goldens import with_reference
from .harness import serve_asgi, serve_gateway, settings_for, until

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from llmflow.gateway.types import ASGIApp, Receive, Scope, Send

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
HANG = {
    "model": "fake-model",
    "messages": [{"role": "user", "content": "hold"}],
    "fake": {"hang": True},
}
REFUSED = [  # (path, body): requests the gateway refuses while the one slot is held
    (CHAT, {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}),
    (
        CHAT,
        {"model": "fake-model", "messages": [{"role": "user", "content": "go"}], "stream": True},
    ),
    ("/v1/completions", {"model": "fake-model", "prompt": "once upon", "max_tokens": 5}),
    ("/v1/completions", {"model": "fake-model", "prompt": [1, 2, 3], "stream": True}),
]
STREAMED = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "stream": True}
SECTIONS: dict[str, Any] = {
    "gate": {"max_concurrency_per_gpu": 1, "queue": {"max_waiting": 0}},
    "streaming": {"sse_flush_interval": 0, "first_token_timeout_ms": None},
    "tenants": [{"name": "crowd", "tier": "normal", "api_keys": ["k-crowd"]}],
}
KEY = {"authorization": "Bearer k-crowd"}
MESSAGES = b'[{"role": "user", "content": "hi"}]'


class Counted:
    """An ASGI app that counts the HTTP requests reaching the wrapped one."""

    def __init__(self, app: ASGIApp) -> None:
        self.app, self.requests = app, 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            self.requests += 1
        await self.app(scope, receive, send)


@dataclass
class Served:
    """One gateway under test: its URL, its app's request counter, its trace, its fake."""

    url: str
    gateway: Gateway
    counted: Counted
    trace: io.StringIO
    fake: FakeVllm
    client: httpx.AsyncClient
    holds: list[asyncio.Task[httpx.Response]] = field(default_factory=list)

    def arrivals(self) -> list[dict[str, Any]]:
        """The trace's arrive lines (once the gateway has stopped and flushed it), without
        their time, the ids numbered by arrival."""
        lines = [json.loads(line) for line in self.trace.getvalue().splitlines()[1:]]
        arrivals = [line for line in lines if "arrive" in line["ev"]]
        for line in arrivals:  # a timer's instant is the clock's, which differs by gateway
            line["act"] = [a for a in line["act"] if "arm" not in a]
        ids = {line["ev"]["arrive"]["id"]: n for n, line in enumerate(arrivals)}
        text = json.dumps([{"ev": line["ev"], "act": line["act"]} for line in arrivals])
        for rid, n in sorted(ids.items(), reverse=True):  # longest first: 1099511627776, 1
            text = text.replace(f'"id": {rid}', f'"id": "r{n}"')
        out: list[dict[str, Any]] = json.loads(text)
        return out

    async def hold_the_slot(self) -> None:
        self.holds.append(asyncio.create_task(self.client.post(CHAT, json=HANG, headers=KEY)))
        await until(lambda: self.fake.running == 1)


@contextlib.asynccontextmanager
async def served(native: bool, **sections: Any) -> AsyncIterator[Served]:
    """A gateway over its own fake, serving streams natively or passing them to the app."""
    fake = FakeVllm()
    async with contextlib.AsyncExitStack() as stack:
        fake_url, _ = await stack.enter_async_context(serve_asgi(fake.app))
        settings = settings_for({"b0": fake_url}, **{**SECTIONS, **sections})
        trace = io.StringIO()
        app = create_app(settings, trace)
        counted = Counted(app)
        url = await stack.enter_async_context(serve_gateway(app, counted, front=native))
        client = await stack.enter_async_context(httpx.AsyncClient(base_url=url, timeout=30))
        s = Served(url, app.state.gateway, counted, trace, fake, client)
        try:
            yield s
        finally:
            for task in s.holds:
                task.cancel()
            await asyncio.gather(*s.holds, return_exceptions=True)
            await until(lambda: fake.running == 0 and s.gateway.runtime.live == 0)


@contextlib.asynccontextmanager
async def served_by_python(**sections: Any) -> AsyncIterator[Served | None]:
    """`served(native=False)`, the reference, while the Python path is there (`paths`); else
    None (the goldens are the reference then)."""
    if False not in paths():
        yield None
        return
    async with served(native=False, **sections) as s:
        yield s


def _by_run(arrivals: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The arrivals less what differs by run (for their goldens): each body's fingerprint
    (keyed with a key random per process) named by its first place, the same body the same
    name; each refusal's Retry-After (`_retried`)."""
    names: dict[int, str] = {}
    out: list[dict[str, Any]] = json.loads(json.dumps(arrivals))
    for line in out:
        arrive = line["ev"]["arrive"]
        if "fingerprint" in arrive:  # left out when none
            arrive["fingerprint"] = names.setdefault(arrive["fingerprint"], f"body {len(names)}")
        for act in line["act"]:
            if "retry_after_s" in act.get("reply", {}):
                act["reply"]["retry_after_s"] = "N"
    return out


def _retried(seen: bytes) -> bytes:
    """A refusal less its Retry-After (for its golden): the crowd's are spread over the drain
    time, which the time the test took shortens, by a second or so from run to run."""
    return re.sub(rb"\r\nretry-after: \d+", b"\r\nretry-after: N", seen)


def _seen(r: httpx.Response) -> bytes:
    """What a client reads of a reply: its status, its headers in order less `date` and
    `x-request-id`, its body."""
    headers = [(k, v) for k, v in r.headers.multi_items() if k not in ("date", "x-request-id")]
    lines = [str(r.status_code), *(f"{k}: {v}" for k, v in headers)]
    return "\r\n".join(lines).encode() + b"\r\n\r\n" + r.content


async def test_a_native_refusal_is_the_python_paths_on_the_wire_and_in_the_trace() -> None:
    async with served(native=True) as fast, served_by_python() as slow:
        both = [gw for gw in (fast, slow) if gw is not None]
        for gw in both:
            await gw.hold_the_slot()
        base = [gw.counted.requests for gw in both]
        retries = []
        for path, body in REFUSED * 2:
            a, *b = [await gw.client.post(path, json=body, headers=KEY) for gw in both]
            assert a.status_code == 429, a.text
            assert a.json()["error"]["code"] == "queue_full", a.text
            native, python = with_reference([_seen(r) for r in (a, *b)], "refusal", _retried)
            assert native == python
            retries.append(int(a.headers["retry-after"]))
        assert retries == sorted(retries)  # the crowd is spread over the drain time
        assert retries[0] < retries[-1]
        # The native gateway's app saw none of them (streamed or not, the front refused each);
        # the other one's saw every one.
        assert fast.counted.requests - base[0] == 0
        if slow is not None:
            assert slow.counted.requests - base[1] == 2 * len(REFUSED)
        metrics = [(await gw.client.get("/metrics")).text for gw in both]
        rejected = [
            [x for x in m.splitlines() if x.startswith('llmflow_requests_total{outcome="rejected"')]
            for m in metrics
        ]
        rejected = list(with_reference(rejected, "rejected"))
        assert rejected[0] == rejected[1]
        assert any(line.endswith(f" {2.0 * len(REFUSED)}") for line in rejected[0]), rejected
    # the gateways have stopped: their traces are flushed
    native, python = with_reference([gw.arrivals() for gw in both], "arrivals", _by_run)
    assert native == python
    refusals = fast.arrivals()[1:]  # after the held slot's
    assert len(refusals) == 2 * len(REFUSED)
    replies = [a["reply"] for r in refusals for a in r["act"] if "reply" in a]
    assert [r["retry_after_s"] for r in replies] == retries
    assert replay_trace(fast.trace.getvalue())[0] > 0  # replays bit for bit


@pytest.mark.parametrize(
    ("body", "headers", "status", "code"),
    [
        (b'{"model": "fake-model", "stream": true, "messages": [', KEY, 400, "invalid_json"),
        (b'{"model": "fake-model", "stream": true, "messages": "hi"}', KEY, 400, "invalid_request"),
        (
            b'{"model": "gpt-17", "stream": true, "messages": %s}' % MESSAGES,
            KEY,
            404,
            "model_not_found",
        ),
        (
            b'{"model": "fake-model", "stream": true, "messages": %s, "n": 500}' % MESSAGES,
            KEY,
            400,
            "n_too_large",
        ),
        (
            b'{"model": "fake-model", "stream": true, "messages": %s}' % MESSAGES,
            {"authorization": "Bearer no"},
            401,
            "invalid_api_key",
        ),
        (
            b'{"model": "fake-model", "stream": true, "messages": %s}' % MESSAGES,
            {},
            401,
            "invalid_api_key",
        ),
    ],
    ids=["json", "type", "model", "limit", "wrong-key", "no-key"],
)
async def test_bad_input_under_a_flood_gets_its_own_error(
    body: bytes, headers: dict[str, str], status: int, code: str
) -> None:
    """While every good request is refused, a bad one still gets its 4xx, as Python's."""
    async with served(native=True) as fast, served_by_python() as slow:
        both = [gw for gw in (fast, slow) if gw is not None]
        for gw in both:
            await gw.hold_the_slot()
        a, *b = [await gw.client.post(CHAT, content=body, headers=headers) for gw in both]
        assert a.status_code == status, a.text
        assert a.json()["error"]["code"] == code
        native, python = with_reference([_seen(r) for r in (a, *b)])
        assert native == python
    assert len(fast.arrivals()) == 1  # it never reached the runtime (the held slot's did)


async def test_requests_the_runtime_admits_go_on_unchanged_on_the_same_connection() -> None:
    """Refusals, then, once the slot is free, a served request on the same keep-alive
    connection: it reaches vLLM with its whole body."""
    async with served(native=True) as gw:
        await gw.hold_the_slot()
        reader, writer = await asyncio.open_connection(*gw.url.removeprefix("http://").split(":"))
        body = json.dumps({**STREAMED, "max_tokens": 3}).encode()
        request = (
            b"POST /v1/chat/completions HTTP/1.1\r\n"
            b"host: localhost\r\nauthorization: Bearer k-crowd\r\n"
            b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body) + body
        )
        for _ in range(3):
            writer.write(request)
            assert (await _response(reader))[0] == 429
        gw.holds.pop().cancel()
        await until(lambda: gw.fake.running == 0 and gw.gateway.runtime.live == 0)
        seen, reached = gw.fake.seen, gw.counted.requests
        writer.write(request[:-5])  # the body in two pieces
        await asyncio.sleep(0.05)
        writer.write(request[-5:])
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 200 "), head
        stream = await asyncio.wait_for(reader.readuntil(b"0\r\n\r\n"), 10)  # the chunked end
        assert b'"content"' in stream, stream
        assert b"data: [DONE]" in stream, stream
        assert gw.fake.seen == seen + 1
        assert gw.fake.bodies[-1]["messages"] == STREAMED["messages"]
        assert gw.counted.requests == reached  # served natively, not by the app
        writer.close()


async def test_a_queued_request_whose_client_leaves_frees_its_place() -> None:
    """A queued native request is still the runtime's to end: its client leaving takes it out
    of the queue, and nothing of it reaches the backend."""
    async with served(
        native=True, gate={"max_concurrency_per_gpu": 1, "queue": {"max_waiting": 2}}
    ) as gw:
        await gw.hold_the_slot()
        _, writer = await asyncio.open_connection(*gw.url.removeprefix("http://").split(":"))
        body = json.dumps({**STREAMED, "max_tokens": 4}).encode()
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\n"
            b"host: localhost\r\nauthorization: Bearer k-crowd\r\n"
            b"content-length: %d\r\n\r\n" % len(body) + body
        )
        await until(lambda: gw.gateway.runtime.queued == 1)
        state = (await gw.client.get("/api/state")).json()["core"]
        assert (state["running"], state["queued"]) == (1, 1), state
        writer.close()
        await until(lambda: gw.gateway.runtime.live == 1)
        state = (await gw.client.get("/api/state")).json()["core"]
        assert (state["running"], state["queued"]) == (1, 0), state
        assert gw.fake.seen == 1  # the held slot's request only
        # the two states only: neither this one nor the held slot's (not streamed, the front's)
        assert gw.counted.requests == 2


async def test_http_1_0_and_connection_close_get_their_refusal_then_eof() -> None:
    async with served(native=True) as gw:
        await gw.hold_the_slot()
        body = json.dumps(STREAMED).encode()
        for first_line, extra in ((b"HTTP/1.0", b""), (b"HTTP/1.1", b"connection: close\r\n")):
            reader, writer = await asyncio.open_connection(
                *gw.url.removeprefix("http://").split(":")
            )
            writer.write(
                b"POST /v1/chat/completions "
                + first_line
                + b"\r\nhost: localhost\r\n"
                + extra
                + b"authorization: Bearer k-crowd\r\ncontent-length: %d\r\n\r\n" % len(body)
                + body
            )
            status, _ = await _response(reader)
            assert status == 429
            assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the gateway
            writer.close()
        assert gw.counted.requests == 0  # none reached the app (the held slot's is the front's)


async def _response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    return int(head.split(b" ", 2)[1]), await reader.readexactly(length)
