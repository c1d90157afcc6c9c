"""Random client mixes through the real gateway: every client gets one well-formed answer, the
slot cap holds throughout (counted by the fake vLLM itself), nothing invalid reaches a backend,
and the gateway returns to zero.

The gateway and its fake vLLM run on a background event loop for the whole module; each example
throws a different crowd at it (fast and slow readers, clients that leave mid-stream, over-long
prompts, bad keys, every tier) and then checks that in-flight, queue and the KV ledger are zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.gateway.harness import Harness, assert_idle, start_gateway
from tests.gateway.sse_client import frames, text_of

from llmflow.gateway.streaming import notice_for

if TYPE_CHECKING:
    from collections.abc import Coroutine, Iterator

    import httpx

T = TypeVar("T")
CAP = 2  # one GPU x 2 slots: small enough that mixes queue and shed
KEYS = {"vip": "k-vip", "normal": "k-normal", "batch": "k-batch"}
TENANTS = [{"name": f"t-{tier}", "tier": tier, "api_keys": [key]} for tier, key in KEYS.items()]
EXAMPLES = max(10, settings().max_examples // 3)  # each example is a real burst of HTTP


class LoopThread:
    """An event loop on a thread of its own, hosting the servers across examples."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


class Served:
    """The loop and the gateway on it (a plain class: Hypothesis prints it in one line)."""

    def __init__(self, loop: LoopThread, harness: Harness) -> None:
        self.loop, self.harness = loop, harness

    def __repr__(self) -> str:
        return f"Served({self.harness.url})"


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    """One gateway (cap 2, queue 4, 1 s deadline) over one fake, for the whole module."""
    loop = LoopThread()
    stack = contextlib.AsyncExitStack()
    harness = loop.run(
        stack.enter_async_context(
            start_gateway(
                tenants=TENANTS,
                gate={"max_concurrency_per_gpu": CAP, "queue": {"max_waiting": 4}},
                timeouts={"total_ms": 1000},
                backpressure={"client_window": 3},
                sla={"ttft_ms": None},
                streaming={"sse_flush_interval": "5ms", "first_token_timeout_ms": 800},
            )
        )
    )
    try:
        yield Served(loop, harness)
    finally:
        loop.run(stack.aclose())
        loop.close()


@dataclass(frozen=True)
class Client:
    kind: str  # fast, slow, leave, overlong, bad_key
    tier: str
    stream: bool
    tokens: int
    itl_ms: int
    leave_after: int
    start_ms: int


clients = st.builds(
    Client,
    kind=st.sampled_from(["fast", "fast", "slow", "leave", "overlong", "bad_key"]),
    tier=st.sampled_from(sorted(KEYS)),
    stream=st.booleans(),
    tokens=st.integers(1, 25),
    itl_ms=st.integers(0, 8),
    leave_after=st.integers(0, 6),
    start_ms=st.integers(0, 40),
)


async def _run(h: Harness, c: Client) -> None:
    await asyncio.sleep(c.start_ms / 1e3)
    content = "x" * 40_000 if c.kind == "overlong" else "hi"
    body = {
        "model": "fake-model",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": c.tokens,
        "stream": c.stream,
        "fake": {"itl": c.itl_ms / 1e3},
    }
    key = "not-a-key" if c.kind == "bad_key" else KEYS[c.tier]
    headers = {"authorization": f"Bearer {key}", "x-user-tier": "vip"}
    if c.kind == "leave":
        await _leave(h, body, headers, c)
        return
    async with h.client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
        if c.kind in ("overlong", "bad_key"):
            await r.aread()
            assert r.status_code == (400 if c.kind == "overlong" else 401)
            return
        if r.status_code != 200:
            await r.aread()
            assert r.status_code in (429, 503), r.text
            assert int(r.headers["retry-after"]) >= 1
            return
        await _check_reply(r, c)


async def _check_reply(r: httpx.Response, c: Client) -> None:
    expected = "".join(f"t{i} " for i in range(c.tokens))
    if not c.stream:
        reply = (await r.aread()) and r.json()
        text, marker = reply["choices"][0]["message"]["content"], reply.get("llmflow")
    else:
        chunks = []
        async for chunk in frames(r):
            chunks.append(chunk)
            if c.kind == "slow":
                await asyncio.sleep(0.004)
        assert chunks[-1] == "[DONE]"
        assert not any(isinstance(x, dict) and "error" in x for x in chunks)
        text, marker = text_of(chunks), chunks[-2].get("llmflow")
    if marker is None:
        assert text == expected
    else:
        assert marker["truncated"] is True
        assert text.endswith(notice_for(marker["reason"]))
        assert expected.startswith(text.removesuffix(notice_for(marker["reason"])))


async def _leave(h: Harness, body: dict[str, Any], headers: dict[str, str], c: Client) -> None:
    if not c.stream:
        task = asyncio.create_task(
            h.client.post("/v1/chat/completions", json=body, headers=headers)
        )
        await asyncio.sleep(c.leave_after * 0.003)
        task.cancel()
        await asyncio.wait([task])
        return
    async with h.client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
        seen = 0
        async for _ in frames(r):
            seen += 1
            if seen > c.leave_after:
                break


async def _mix(h: Harness, crowd: list[Client]) -> None:
    fake = h.fake
    seen_before = fake.seen
    fake.peak_running = fake.running  # the fake's own count of requests running at once
    await asyncio.gather(*(_run(h, c) for c in crowd))
    assert fake.peak_running <= CAP
    forwardable = sum(c.kind not in ("overlong", "bad_key") for c in crowd)
    assert fake.seen - seen_before <= forwardable
    await assert_idle(h)


@settings(max_examples=EXAMPLES)
@given(crowd=st.lists(clients, min_size=1, max_size=10))
def test_random_client_mixes_leave_the_gateway_idle(served: Served, crowd: list[Client]) -> None:
    served.loop.run(_mix(served.harness, crowd))
