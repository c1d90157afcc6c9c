"""Broken `/metrics`: slow, failing, or garbage. Admission turns conservative, nothing crashes.

A backend that answers but gives no usable metrics is alive: it stays up, and as its last
scrape ages the stale-metrics rule holds it to half its slots (counted by the fake's own peak),
with one backend or beside a healthy one; when its metrics come back, so do its slots. (Only a
backend nothing answers is taken down: `test_backend_killed.py`.) A scrape that succeeds but
arrives late leaves the metrics stale between scrapes, and the same rule holds end to end.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import pytest

from tests.gateway.harness import start_gateway, until

from .replies import CHAT, chat
from .zero import assert_back_to_zero, fakes_running

if TYPE_CHECKING:
    from tests.gateway.fake_vllm import FakeVllm
    from tests.gateway.harness import Harness

pytestmark = pytest.mark.anyio

REQUESTS = 12
BROKEN = {
    "slow": {"metrics_delay": 1.0},  # past the scrape's timeout (0.2 s at a 100 ms period)
    "failing": {"metrics_status": 500},
    "garbage": {"metrics_garbage": True},
}
HEALED = {"metrics_delay": 0.0, "metrics_status": 200, "metrics_garbage": False}


def _break(fake: FakeVllm, how: dict[str, object]) -> None:
    for key, value in how.items():
        setattr(fake, key, value)


CAP = 4


def _held(fake: FakeVllm) -> None:
    fake.default = {"step": True}  # every reply waits for `release`: the peak is what ran


async def _core_backend(h: Harness, name: str) -> dict[str, Any]:
    state = (await h.client.get("/api/state")).json()
    return next(b for b in state["core"]["backends"] if b["name"] == name)


async def _until_stale(h: Harness, name: str, stale: bool) -> None:
    deadline = asyncio.get_running_loop().time() + 10
    while (await _core_backend(h, name))["stale"] is not stale:
        assert asyncio.get_running_loop().time() < deadline, await _core_backend(h, name)
        await asyncio.sleep(0.05)


def _settings() -> dict[str, Any]:
    return {
        "gate": {"max_concurrency_per_gpu": CAP, "queue": {"max_waiting": 16}},
        "metrics": {"scrape_interval_ms": 100, "stale_after_ms": 500},
        "sla": {"ttft_ms": None},
        "streaming": {"first_token_timeout_ms": None},
    }


@pytest.mark.parametrize("fault", list(BROKEN))
async def test_an_unobservable_backend_keeps_half_its_slots_until_its_metrics_return(
    fault: str,
) -> None:
    async with start_gateway(n_backends=2, **_settings()) as h:
        b0, b1 = h.fakes["b0"], h.fakes["b1"]
        _break(b0, BROKEN[fault])
        await _until_stale(h, "b0", stale=True)
        state = (await h.client.get("/api/state")).json()["backends"]["b0"]
        assert state["healthy"] is True, state  # it answers: alive, only unobserved
        assert state["last_error"], state
        _held(b0)
        _held(b1)
        body = chat(stream=False, max_tokens=2)
        tasks = [asyncio.create_task(h.client.post(CHAT, json=body)) for _ in range(3 * CAP)]
        await until(lambda: (b0.running, b1.running) == (CAP // 2, CAP))
        await asyncio.sleep(0.2)  # time for a third on b0 to (wrongly) start
        assert (b0.peak_running, b1.peak_running) == (CAP // 2, CAP)  # the fakes' own counts
        _break(b0, HEALED)
        await _until_stale(h, "b0", stale=False)
        await until(lambda: b0.running == CAP, timeout_s=5)  # observed again: all its slots
        b0.release(12 * CAP)
        b1.release(12 * CAP)
        results = await asyncio.gather(*tasks)
        assert [r.status_code for r in results] == [200] * 3 * CAP
        assert b0.completed + b1.completed == 3 * CAP
        await assert_back_to_zero(h.url, fakes_running(h.fakes.values()))


@pytest.mark.parametrize("fault", list(BROKEN))
async def test_a_lone_unobservable_backend_still_serves_at_half_its_slots(fault: str) -> None:
    async with start_gateway(**_settings()) as h:
        fake = h.fake
        _break(fake, BROKEN[fault])
        await _until_stale(h, "b0", stale=True)
        _held(fake)
        bodies = [chat(stream=s, max_tokens=2) for s in [True, False] * CAP]
        tasks = [asyncio.create_task(h.client.post(CHAT, json=b)) for b in bodies]
        await until(lambda: fake.running == CAP // 2)
        await asyncio.sleep(0.2)
        assert fake.peak_running == CAP // 2
        assert (await h.client.get("/healthz")).status_code == 200  # up, and says so
        fake.release(12 * CAP)
        results = await asyncio.gather(*tasks)
        assert [r.status_code for r in results] == [200] * 2 * CAP  # all served, in halves
        assert fake.peak_running == CAP // 2
        _break(fake, HEALED)
        await assert_back_to_zero(h.url, fakes_running(h.fakes.values()))


async def test_late_scrapes_leave_metrics_stale_and_the_backend_gets_half_its_slots() -> None:
    """Each scrape succeeds but takes 1.5 s, and metrics count as stale after 300 ms: between
    scrapes only half the cap may run (the fake's own peak), a fresh scrape lets the rest in."""
    cap = 4
    async with start_gateway(
        gate={"max_concurrency_per_gpu": cap, "queue": {"max_waiting": 8}},
        metrics={"scrape_interval_ms": 1000, "stale_after_ms": 300},
        sla={"ttft_ms": None},
        streaming={"first_token_timeout_ms": None},
    ) as h:
        fake = h.fake
        fake.metrics_delay = 1.5  # under the scrape's 2 s timeout: late, not failed
        fake.default = {"step": True}
        began = fake.metrics_scrapes
        await until(lambda: fake.metrics_scrapes > began, timeout_s=10)  # one just began
        await asyncio.sleep(0.5)  # the last one ended just before: stale now, for ~1 s more
        assert (await h.client.get("/api/state")).json()["core"]["backends"][0]["stale"]
        body = chat(stream=False, max_tokens=2)
        tasks = [asyncio.create_task(h.client.post(CHAT, json=body)) for _ in range(cap)]
        await until(lambda: fake.running == cap // 2)
        await asyncio.sleep(0.2)  # time for a third to (wrongly) start
        assert (fake.seen, fake.peak_running) == (cap // 2, cap // 2)
        await until(lambda: fake.running == cap, timeout_s=5)  # the late scrape lands: fresh
        fake.release(2 * cap)
        assert [r.status_code for r in await asyncio.gather(*tasks)] == [200] * cap
        fake.metrics_delay = 0.0
        await assert_back_to_zero(h.url, fakes_running(h.fakes.values()))
