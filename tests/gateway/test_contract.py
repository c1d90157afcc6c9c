"""The status contract (`gateway/contract.py`), checked from outside.

Every reason in `REFUSALS` is driven over real HTTP (or a real WebSocket) against a gateway in
front of a fake vLLM, and what comes back must be what the contract says: the status, the
`x-llmflow-reason` header equal to the body's `error.code`, `Retry-After` as a positive whole
number on every 429 and wherever the rule says, never a 500; a cut names its reason in the
notice. The reasons are read from `REFUSALS` itself, so a new one fails here until it has a
driver; `docs/gateway.md`'s table is compared with it row by row.
"""

from __future__ import annotations

import asyncio
import json
import re
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from websockets.asyncio.client import connect

from llmflow.gateway.contract import REASON_HEADER, REFUSALS
from llmflow.gateway.ws import MAX_PENDING
from tests.processes import GatewayProcess

from .harness import start_gateway, start_gateway_losing_its_backend, start_sim_gateway, until
from .outside import fake_in_thread
from .sse_client import frames

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    import httpx

    from .harness import Harness

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parents[2]
CHAT = "/v1/chat/completions"
ONE_SLOT = {"max_concurrency_per_gpu": 1}


def chat(content: str = "hi", **extra: Any) -> dict[str, Any]:
    return {"model": "fake-model", "messages": [{"role": "user", "content": content}], **extra}


def check(status: int, headers: dict[str, str], error: dict[str, Any], reason: str) -> None:
    """One refusal against its rule: status, header, body code, Retry-After."""
    rule = REFUSALS[reason]
    assert status != 500, (reason, error)
    assert status in rule.statuses, (reason, status, error)
    assert headers.get(REASON_HEADER) == reason == error["code"], (headers, error)
    retry = headers.get("retry-after")
    if rule.retry_after or status == 429:
        assert retry is not None, reason
        assert retry.isdigit(), (reason, retry)
        assert int(retry) >= 1, (reason, retry)
    else:
        assert retry is None, (reason, retry)


def check_http(r: httpx.Response, reason: str) -> None:
    check(r.status_code, dict(r.headers), r.json()["error"], reason)


def check_ws(frame: dict[str, Any], reason: str) -> None:
    """A WebSocket `error` frame: `status`, `reason` and `retry_after` as HTTP's head."""
    assert frame["type"] == "error", frame
    headers = {REASON_HEADER: frame["reason"]}
    if "retry_after" in frame:
        headers["retry-after"] = str(frame["retry_after"])
    check(frame["status"], headers, frame["error"], reason)


def check_cut(chunks: list[dict[str, Any]], reason: str) -> None:
    """A streamed reply the gateway cut: the notice's marker names the reason."""
    assert REFUSALS[reason].cut, reason
    marked = [c for c in chunks if "llmflow" in c]
    assert [c["llmflow"] for c in marked] == [{"truncated": True, "reason": reason}], chunks[-3:]


async def _held(h: Harness, **body: Any) -> asyncio.Task[httpx.Response]:
    """A request that holds the one slot (the fake steps only when released)."""
    task = asyncio.create_task(h.client.post(CHAT, json=chat(fake={"step": True}, **body)))
    await until(lambda: h.fake.running == 1)
    return task


def _ws_url(h: Harness) -> str:
    return h.url.replace("http://", "ws://") + "/v1/ws"


def _ws_request(rid: Any, **body: Any) -> str:
    return json.dumps({"type": "request", "id": rid, "endpoint": "chat", "body": chat(**body)})


async def _scrapes(h: Harness, n: int = 2) -> None:
    seen = h.fake.metrics_scrapes
    await until(lambda: h.fake.metrics_scrapes >= seen + n)


# ---- one driver per reason ---------------------------------------------------------------------


async def queue_full() -> None:
    async with start_gateway(gate={**ONE_SLOT, "queue": {"max_waiting": 0}}) as h:
        first = await _held(h, max_tokens=1)
        check_http(await h.client.post(CHAT, json=chat(max_tokens=1)), "queue_full")
        h.fake.release(1)
        assert (await first).status_code == 200


async def tier_shed() -> None:
    queue = {"max_waiting": 2, "follow_drain": False}  # `normal` sheds at 0.8: one place
    async with start_gateway(gate={**ONE_SLOT, "queue": queue}) as h:
        first = await _held(h, max_tokens=1)
        second = asyncio.create_task(h.client.post(CHAT, json=chat(max_tokens=1)))
        await until(lambda: h.gateway.runtime.queued == 1)
        check_http(await h.client.post(CHAT, json=chat(max_tokens=1)), "tier_shed")
        h.fake.release(2)
        assert [(await t).status_code for t in (first, second)] == [200, 200]


async def kv_pressure() -> None:
    async with start_gateway() as h:
        h.fake.kv_usage = 0.99  # over `kv.pressure_threshold` (0.95) on the only backend
        await _scrapes(h)
        check_http(await h.client.post(CHAT, json=chat(max_tokens=1)), "kv_pressure")


async def ttft_sla() -> None:
    # The tier keeps arriving faster than its one slot drains, and the prompts waiting ahead of
    # a newcomer overshoot a 1 ms SLA: once the arrivals pass the drain, it refuses.
    queue = {"max_waiting": 100, "follow_drain": False}
    async with start_gateway(gate={**ONE_SLOT, "queue": queue}, sla={"ttft_ms": 1}) as h:
        first = await _held(h, max_tokens=1)
        waiting: list[asyncio.Task[httpx.Response]] = []
        refused = None
        while refused is None and len(waiting) < 30:
            waiting.append(
                asyncio.create_task(h.client.post(CHAT, json=chat("x" * 4000, max_tokens=1)))
            )
            await until(
                lambda: any(t.done() for t in waiting) or h.gateway.runtime.queued == len(waiting)
            )
            refused = next((t.result() for t in waiting if t.done()), None)
        assert refused is not None, "no ttft_sla refusal within 30 arrivals"
        check_http(refused, "ttft_sla")
        h.fake.release(len(waiting))
        assert (await first).status_code == 200
        await asyncio.gather(*waiting)


async def preemption_breaker() -> None:
    # vLLM reports preemptions: the breaker halves the unprotected tier's 2 places to 1.
    queue = {"max_waiting": 2, "follow_drain": False}
    tiers = [{"name": "normal", "shed_at": 1.0}]
    async with start_gateway(gate={**ONE_SLOT, "queue": queue}, tiers=tiers) as h:
        first = await _held(h, max_tokens=1)
        second = asyncio.create_task(h.client.post(CHAT, json=chat(max_tokens=1)))
        await until(lambda: h.gateway.runtime.queued == 1)
        await _scrapes(h, 1)
        h.fake.preemptions = 10
        await _scrapes(h)
        check_http(await h.client.post(CHAT, json=chat(max_tokens=1)), "preemption_breaker")
        h.fake.release(2)
        assert [(await t).status_code for t in (first, second)] == [200, 200]


async def displaced() -> None:
    tenants = [
        {"name": "heavy", "tier": "vip", "api_keys": ["kh"]},
        {"name": "light", "tier": "vip", "api_keys": ["kl"]},
    ]
    queue = {"max_waiting": 2, "follow_drain": False}
    async with start_gateway(tenants=tenants, gate={**ONE_SLOT, "queue": queue}) as h:
        heavy, light = {"authorization": "Bearer kh"}, {"authorization": "Bearer kl"}

        def post(headers: dict[str, str]) -> asyncio.Task[httpx.Response]:
            body = chat(max_tokens=1, fake={"step": True})
            return asyncio.create_task(h.client.post(CHAT, json=body, headers=headers))

        tasks = [post(heavy)]
        await until(lambda: h.fake.running == 1)
        for n in (1, 2):
            tasks.append(post(heavy))
            await until(lambda n=n: h.gateway.runtime.queued == n)  # type: ignore[misc]
        tasks.append(post(light))
        check_http(await tasks.pop(2), "displaced")  # the heavy tenant's newest
        h.fake.release(3)
        assert [(await t).status_code for t in tasks] == [200] * 3


async def rate_limited() -> None:
    tenants = [{"name": "slow", "tier": "normal", "api_keys": ["ks"], "requests_per_s": 1}]
    async with start_gateway(tenants=tenants) as h:
        key = {"authorization": "Bearer ks"}
        assert (await h.client.post(CHAT, json=chat(max_tokens=1), headers=key)).is_success
        check_http(await h.client.post(CHAT, json=chat(max_tokens=1), headers=key), "rate_limited")


async def light_lane_full() -> None:
    sim = {"light_hold_s": 0.4}
    async with start_sim_gateway(sim_options=sim, backend={"light_concurrency": 1}) as h:
        body = {"model": "fake-model", "input": "x"}
        replies = await asyncio.gather(
            *(h.client.post("/v1/embeddings", json=body) for _ in range(2))
        )
        assert sorted(r.status_code for r in replies) == [200, 429]
        check_http(next(r for r in replies if r.status_code == 429), "light_lane_full")


async def too_many_pending_requests() -> None:
    async with start_gateway(backpressure={"client_window": 1}) as h, connect(_ws_url(h)) as ws:
        await ws.send(_ws_request("first", fake={"step": True}))
        for i in range(MAX_PENDING + 1):
            await ws.send(_ws_request(i))
        frame = json.loads(await asyncio.wait_for(ws.recv(), 5))
        while frame["type"] != "error":
            frame = json.loads(await asyncio.wait_for(ws.recv(), 5))
        check_ws(frame, "too_many_pending_requests")
        await ws.send(json.dumps({"type": "cancel"}))
        await until(lambda: h.fake.running == 0)


async def no_healthy_backend() -> None:
    async with start_gateway(metrics={"scrape_interval_ms": 50, "stale_after_ms": 200}) as h:
        h.fake.metrics_status = 503  # a proxy says nothing answers: marked down
        assert h.gateway.scraper is not None
        await until(lambda: not h.gateway.scraper.states["b0"].healthy)  # type: ignore[union-attr]
        check_http(await h.client.post(CHAT, json=chat(max_tokens=1)), "no_healthy_backend")
        assert h.fake.seen == 0


async def draining() -> None:
    async with start_gateway(server={"drain_timeout_ms": 5000}) as h:
        first = await _held(h, max_tokens=1)
        drain = asyncio.create_task(h.gateway.drain())  # as SIGTERM does
        await until(lambda: h.gateway.draining)
        check_http(await h.client.post(CHAT, json=chat(max_tokens=1)), "draining")
        h.fake.release(1)
        assert (await first).status_code == 200
        await drain


async def too_many_connections() -> None:
    # A gateway process allowed 160 descriptors refuses connections from the 96th on (it keeps
    # 64 for upstream), before reading a request, with 503 and Retry-After.
    with tempfile.TemporaryDirectory() as tmp, fake_in_thread() as (url, _fake):
        config = {"backends": [{"name": "b0", "url": url, "models": ["fake-model"]}]}
        with GatewayProcess(config, Path(tmp), max_open_files=160) as gw:
            conns = [await asyncio.open_connection("127.0.0.1", gw.port) for _ in range(110)]
            _, writer = conns[-1]
            writer.write(b"GET /healthz HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
            raw = await asyncio.wait_for(conns[-1][0].read(), 5)
            for _, w in conns:
                w.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    check(int(lines[0].split()[1]), headers, json.loads(body)["error"], "too_many_connections")


async def queue_timeout() -> None:
    gate = {**ONE_SLOT, "queue": {"max_wait_ms": 200}}
    async with start_gateway(gate=gate, streaming={"first_token_timeout_ms": None}) as h:
        first = await _held(h, max_tokens=1)
        check_http(await h.client.post(CHAT, json=chat(max_tokens=1)), "queue_timeout")
        h.fake.release(1)
        assert (await first).status_code == 200


async def deadline() -> None:
    # The total deadline passes for a stream running (cut: the notice names it), for a batch
    # request still queued (503: the vip one that came after it took the slot first), and for
    # that vip one, whole (a 200 with the notice, and the header).
    tenants = [
        {"name": "n", "tier": "normal", "api_keys": ["kn"]},
        {"name": "b", "tier": "batch", "api_keys": ["kb"]},
        {"name": "v", "tier": "vip", "api_keys": ["kv"]},
    ]
    async with start_gateway(gate=ONE_SLOT, tenants=tenants, timeouts={"total_ms": 300}) as h:
        slow = {"fake": {"itl": 0.02}, "max_tokens": 1000}
        running = asyncio.create_task(
            h.client.post(
                CHAT, json=chat(stream=True, **slow), headers={"authorization": "Bearer kn"}
            )
        )
        await until(lambda: h.fake.running == 1)
        batch = asyncio.create_task(
            h.client.post(CHAT, json=chat(max_tokens=1), headers={"authorization": "Bearer kb"})
        )
        await until(lambda: h.gateway.runtime.queued == 1)
        vip = asyncio.create_task(
            h.client.post(CHAT, json=chat(**slow), headers={"authorization": "Bearer kv"})
        )
        await until(lambda: h.gateway.runtime.queued == 2)
        check_cut([c async for c in frames(await running) if c != "[DONE]"], "deadline")
        check_http(await batch, "deadline")
        whole = await vip
        assert whole.status_code == 200
        assert whole.headers[REASON_HEADER] == "deadline"
        assert whole.json()["llmflow"] == {"truncated": True, "reason": "deadline"}


async def shutdown() -> None:
    async with start_gateway(gate=ONE_SLOT, server={"drain_timeout_ms": 100}) as h:
        running = asyncio.create_task(
            h.client.post(CHAT, json=chat(stream=True, fake={"itl": 0.01}, max_tokens=1000))
        )
        await until(lambda: h.fake.running == 1)
        queued = asyncio.create_task(h.client.post(CHAT, json=chat(max_tokens=1)))
        await until(lambda: h.gateway.runtime.queued == 1)
        await h.gateway.drain()
        check_http(await queued, "shutdown")
        check_cut([c async for c in frames(await running) if c != "[DONE]"], "shutdown")


async def first_token_timeout() -> None:
    for mode in ("error", "degrade"):
        streaming = {"first_token_timeout_ms": 150, "on_first_token_timeout": mode}
        async with start_gateway(streaming=streaming) as h:
            if mode == "error":
                r = await h.client.post(CHAT, json=chat(fake={"hang": True}))
                check_http(r, "first_token_timeout")
            else:
                r = await h.client.post(CHAT, json=chat(stream=True, fake={"hang": True}))
                chunks = [c async for c in frames(r) if c != "[DONE]"]
                check_cut(chunks, "first_token_timeout")


async def backend_unavailable() -> None:
    async with start_gateway_losing_its_backend() as h:
        check_http(await h.client.post(CHAT, json=chat(max_tokens=1)), "backend_unavailable")


async def backend_error() -> None:
    async with start_gateway() as h:
        r = await h.client.post(CHAT, json=chat(max_tokens=1, fake={"status": 500}))
        check_http(r, "backend_error")
        # streaming already: the failure comes in-band, with the same code
        r = await h.client.post(CHAT, json=chat(stream=True, max_tokens=5, fake={"error_after": 2}))
        errors = [c["error"] for c in [c async for c in frames(r)] if "error" in c]
        assert r.status_code == 200
        assert [e["code"] for e in errors] == ["backend_error"]


async def client_deadline() -> None:
    # The held slot drains one request per 10 s (the prior hold): a 2 s deadline cannot be met.
    async with start_gateway(gate={**ONE_SLOT, "queue": {"max_waiting": 4}}) as h:
        first = await _held(h, max_tokens=1)
        late = await h.client.post(
            CHAT, json=chat(max_tokens=1), headers={"x-llmflow-deadline-ms": "2000"}
        )
        check_http(late, "client_deadline")
        h.fake.release(1)
        assert (await first).status_code == 200


async def client_stall() -> None:
    # Nothing reaches a client that stopped reading; a WebSocket client that reads again finds
    # the `end` naming the reason.
    config = {"client_window": 2, "stall_timeout_ms": 200}
    async with start_gateway(backpressure=config) as h, connect(_ws_url(h)) as ws:
        await ws.send(_ws_request("r", max_tokens=500, fake={"itl": 0.005}))
        await until(lambda: h.fake.aborted == 1)
        frames_ = []
        while not frames_ or frames_[-1]["type"] != "end":
            frames_.append(json.loads(await asyncio.wait_for(ws.recv(), 5)))
        assert frames_[-1]["reason"] == "client_stall"
        assert REFUSALS["client_stall"].cut


DRIVERS: dict[str, Callable[[], Awaitable[None]]] = {
    f.__name__: f
    for f in (
        queue_full,
        tier_shed,
        kv_pressure,
        ttft_sla,
        preemption_breaker,
        displaced,
        rate_limited,
        light_lane_full,
        too_many_pending_requests,
        no_healthy_backend,
        draining,
        too_many_connections,
        queue_timeout,
        deadline,
        shutdown,
        first_token_timeout,
        backend_unavailable,
        backend_error,
        client_stall,
        client_deadline,
    )
}


@pytest.mark.parametrize("reason", sorted(REFUSALS))
async def test_every_refusal_obeys_the_contract(reason: str) -> None:
    assert reason in DRIVERS, f"{reason} is in REFUSALS: drive it from outside here"
    await DRIVERS[reason]()


async def test_every_path_renders_a_refusal_alike() -> None:
    """One refusal (`queue_full`) through each way in: the route (unstreamed, with and without a
    `traceparent`), a stream (the front's native path), completions, Responses, and a
    WebSocket."""
    async with start_gateway(gate={**ONE_SLOT, "queue": {"max_waiting": 0}}) as h:
        first = await _held(h, max_tokens=1)
        traced = {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}
        for path, body, headers in (
            (CHAT, chat(max_tokens=1), {}),
            (CHAT, chat(max_tokens=1), traced),
            (CHAT, chat(max_tokens=1, stream=True), {}),
            ("/v1/completions", {"model": "fake-model", "prompt": "hi", "max_tokens": 1}, {}),
            ("/v1/responses", {"model": "fake-model", "input": "hi"}, {}),
            ("/v1/responses", {"model": "fake-model", "input": "hi", "stream": True}, {}),
        ):
            check_http(await h.client.post(path, json=body, headers=headers), "queue_full")
        async with connect(_ws_url(h)) as ws:
            await ws.send(_ws_request("r", max_tokens=1))
            check_ws(json.loads(await asyncio.wait_for(ws.recv(), 5)), "queue_full")
        h.fake.release(1)
        assert (await first).status_code == 200
        assert h.fake.seen == 1


async def test_client_errors_carry_the_reason_header_too() -> None:
    """Every error answer, from each writer: the app's handlers, the body-limit middleware, the
    protocol's own (bad HTTP, a head too large), a WebSocket upgrade refused; and vLLM's own 4xx."""
    tenants = [{"name": "t", "tier": "normal", "api_keys": ["k"]}]
    server = {"max_body_bytes": 1024}
    async with start_gateway(
        tenants=tenants, server=server, limits={"max_header_bytes": 4096}
    ) as h:
        key = {"authorization": "Bearer k"}
        cases = [
            (await h.client.post(CHAT, json=chat()), 401, "invalid_api_key"),
            (await h.client.post(CHAT, content=b"{", headers=key), 400, "invalid_json"),
            (
                await h.client.post(CHAT, json=chat(model="nope"), headers=key),
                404,
                "model_not_found",
            ),
            (await h.client.post(CHAT, json=chat("x" * 2000), headers=key), 413, "body_too_large"),
            (await h.client.get("/v1/nothing", headers=key), 404, "not_found"),
        ]
        for r, status, code in cases:
            assert (r.status_code, r.json()["error"]["code"]) == (status, code)
            assert r.headers[REASON_HEADER] == code
        # vLLM's own refusal keeps vLLM's body (its `code` is the status) and says so
        vllm = await h.client.post(CHAT, json=chat(fake={"status": 400}), headers=key)
        assert (vllm.status_code, vllm.json()["error"]["code"]) == (400, 400)
        assert vllm.headers[REASON_HEADER] == "backend_rejected"
        for raw, status, code in (
            (b"NOT HTTP\r\n\r\n", 400, "invalid_http"),
            (b"GET / HTTP/1.1\r\nx: " + b"y" * 8000 + b"\r\n\r\n", 431, "headers_too_large"),
            (
                b"GET /v1/ws HTTP/1.1\r\nhost: 127.0.0.1\r\nupgrade: websocket\r\n"
                b"connection: Upgrade\r\nsec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                b"sec-websocket-version: 13\r\n\r\n",
                401,
                "invalid_api_key",
            ),
        ):
            head = (await _exchange(h, raw)).split(b"\r\n\r\n", 1)[0].decode().lower()
            assert head.startswith(f"http/1.1 {status}"), head
            assert f"{REASON_HEADER}: {code}" in head.split("\r\n"), head
        assert h.fake.seen == 1  # the one vLLM refused


async def test_a_cut_response_names_its_reason() -> None:
    """Responses: streamed, the `error` event's code; whole, `incomplete_details` and the
    header."""
    body = {"model": "fake-model", "input": "hi", "max_output_tokens": 3000, "ignore_eos": True}
    async with start_sim_gateway(timeouts={"total_ms": 300}) as h:
        whole = await h.client.post("/v1/responses", json=body)
        async with h.client.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
            lines = [line async for line in r.aiter_lines()]
    assert whole.status_code == 200
    assert whole.headers[REASON_HEADER] == "deadline"
    assert whole.json()["incomplete_details"] == {"reason": "deadline"}
    assert r.status_code == 200
    events = [line for line in lines if line.startswith("event: ")]
    data = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert events[-1] == "event: error"
    assert json.loads(data[-1])["code"] == "deadline"


async def _exchange(h: Harness, raw: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", int(h.url.rsplit(":", 1)[1]))
    writer.write(raw)
    try:
        return await asyncio.wait_for(reader.read(65536), 5)
    finally:
        writer.close()


# ---- the table and the code agree ---------------------------------------------------------------


def _docs_rows() -> dict[str, tuple[str, ...]]:
    text = (ROOT / "docs" / "gateway.md").read_text()
    section = text.split("### Status contract", 1)[1].split("\n### ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and cells[1].startswith("`"):
            rows[cells[1].strip("`")] = tuple(cells)
    return rows


def test_the_docs_table_is_the_contract() -> None:
    rows = _docs_rows()
    assert list(rows) == list(REFUSALS)  # same reasons, same order
    for reason, rule in REFUSALS.items():
        status, _, retry, cut, llm_d, _ = rows[reason]
        assert status == (", ".join(map(str, rule.statuses)) or "—"), reason
        assert retry == ("always" if rule.retry_after else "never"), reason
        assert cut == ("yes" if rule.cut else "no"), reason
        first = re.match(r"`([a-z-]+)`|none", llm_d)
        assert first is not None, llm_d
        assert first.group(1) == rule.llm_d, reason


def test_every_reason_the_core_renders_is_in_the_contract() -> None:
    reply = (ROOT / "rust/src/runtime/reply.rs").read_text()
    core = set(re.findall(r'Self::\w+ => "(\w+)"', reply)) - {"upstream_error"}  # backend_*
    lines = (ROOT / "rust/src/light.rs").read_text().splitlines()
    light = {name for line in lines if "reason:" in line for name in re.findall(r'"(\w+)"', line)}
    assert {"queue_full", "deadline"} <= core
    assert {"light_lane_full", "tier_shed"} <= light
    assert core | light <= set(REFUSALS), (core | light) - set(REFUSALS)
