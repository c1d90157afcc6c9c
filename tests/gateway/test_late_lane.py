"""Late lanes on the wire: in an overload the queue cannot hold, a request past its TTFT SLA (or
a client's retry, known by its body, of a request refused longer ago than that) waits behind the
requests still on time; with `sla.late_requests_yield: false`, first come, first served.

The order is read from the fake vLLM: the bodies it received, in the order it received them.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import pytest

from .harness import Harness, start_gateway, until

if TYPE_CHECKING:
    import httpx

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
SLA_MS = 500.0
PAST_SLA_S = 0.8


def _body(tag: str) -> dict[str, Any]:
    """A one-token chat request the fake vLLM answers at one `release()`."""
    return {
        "model": "fake-model",
        "messages": [{"role": "user", "content": tag}],
        "max_tokens": 20,
        "fake": {"tokens": 1},
    }


def _gateway(yields: bool, max_waiting: int) -> Any:
    return start_gateway(
        tiers=[{"name": "normal", "shed_at": 1.0}],
        default_tier="normal",
        gate={
            "max_concurrency_per_gpu": 1,
            "queue": {"max_waiting": max_waiting, "max_wait_ms": 10_000, "follow_drain": False},
        },
        sla={"ttft_ms": SLA_MS, "late_requests_yield": yields},
    )


def _started(h: Harness) -> list[str]:
    return [b["messages"][0]["content"] for b in h.fake.bodies]


async def _post(h: Harness, tag: str, queued: int | None = None) -> asyncio.Task[httpx.Response]:
    """Send one request; wait until it runs or waits (`queued` waiting in all)."""
    task = asyncio.create_task(h.client.post(CHAT, json=_body(tag)))
    if queued is not None:
        await until(lambda: h.gateway.runtime.queued == queued)
    return task


async def _release_until(h: Harness, started: int) -> None:
    """End the running request; wait until `started` requests have reached vLLM."""
    await until(lambda: h.fake.running == 1)
    h.fake.release()
    await until(lambda: len(h.fake.bodies) == started)


async def _finish(h: Harness, tasks: list[asyncio.Task[httpx.Response]]) -> list[int]:
    while not all(t.done() for t in tasks):
        if h.fake.running:
            h.fake.release()
        await asyncio.sleep(0.01)
    return [t.result().status_code for t in tasks]


@pytest.mark.parametrize("yields", [True, False], ids=["late-yield", "one-lane"])
async def test_a_request_past_its_sla_yields_to_one_still_on_time(yields: bool) -> None:
    """One slot. Ten requests queue behind the one running, a burst of a minute's worth at a
    slot that drains one per 10 s (the prior hold); 0.8 s later, past their 0.5 s SLA, an
    eleventh comes. When the slot frees it goes first: the ten can no longer be on time."""
    async with _gateway(yields, max_waiting=16) as h:
        h.fake.default = {"step": True}
        tasks = [await _post(h, "running")]
        await until(lambda: h.fake.running == 1)
        for i in range(10):
            tasks.append(await _post(h, f"early-{i}", queued=i + 1))
        await asyncio.sleep(PAST_SLA_S)
        tasks.append(await _post(h, "fresh", queued=11))
        await _release_until(h, started=2)
        assert _started(h)[1] == ("fresh" if yields else "early-0")
        assert await _finish(h, tasks) == [200] * 12
        rest = _started(h)[2:] if yields else _started(h)[1:-1]
        assert rest == [f"early-{i}" for i in range(10)]  # the late ones keep their order


@pytest.mark.parametrize("yields", [True, False], ids=["late-yield", "one-lane"])
async def test_a_clients_retry_is_known_by_its_body(yields: bool) -> None:
    """One slot, held throughout, and four places. Four requests wait; "retry" is refused (the
    queue is full), and eight more besides, an overload the queue cannot hold. Past the SLA,
    two waiting clients leave, the client of "retry" sends it again, the same bytes, then a new
    client sends "fresh". The core knows the retry from its body: judged from its first
    arrival it is late, and waits behind "fresh" and behind the two that waited before it was
    first refused."""
    async with _gateway(yields, max_waiting=4) as h:
        h.fake.default = {"step": True}
        tasks = [await _post(h, "running")]
        await until(lambda: h.fake.running == 1)
        early = [await _post(h, f"early-{i}", queued=i + 1) for i in range(4)]
        refused = [await h.client.post(CHAT, json=_body("retry"))]
        refused += [await h.client.post(CHAT, json=_body(f"other-{i}")) for i in range(8)]
        assert [r.status_code for r in refused] == [429] * 9
        await asyncio.sleep(PAST_SLA_S)
        for gone in early[:2]:  # leaving frees their places; nothing completes, nothing starts
            gone.cancel()
        await until(lambda: h.gateway.runtime.queued == 2)
        tasks += early[2:]
        tasks.append(await _post(h, "retry", queued=3))
        tasks.append(await _post(h, "fresh", queued=4))
        assert await _finish(h, tasks) == [200] * 5
        order = _started(h)[1:]
        if yields:
            assert order == ["fresh", "early-2", "early-3", "retry"]
        else:  # one lane, first come, first served: the retry is a new arrival
            assert order == ["early-2", "early-3", "retry", "fresh"]
        counters = (await h.client.get("/api/state")).json()["core"]["counters"]
        assert counters["retries_known"] == (1 if yields else 0)
        assert counters["late"] == (5 if yields else 0)  # the four early ones, then the retry
        metrics = (await h.client.get("/metrics")).text
        assert f"llmflow_retries_known_total {counters['retries_known']}.0" in metrics
        assert f"llmflow_late_requests_total {counters['late']}.0" in metrics
