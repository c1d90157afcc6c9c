"""Broken `/metrics`: slow, failing, or garbage. Admission turns conservative, nothing crashes.

A backend the gateway cannot observe takes no new work: with two backends every request is
served by the other (counted by the fakes), with one the gateway answers a fast 503 with
Retry-After; when its metrics come back, so does its traffic. A scrape that succeeds but
arrives late leaves the backend's metrics stale between scrapes, and the stale-metrics rule
(half the slots until a fresh scrape) holds end to end, counted by the fake's peak.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import pytest

from gateway.harness import start_gateway, until

from .replies import CHAT, chat
from .zero import assert_back_to_zero, fakes_running

if TYPE_CHECKING:
    from gateway.fake_vllm import FakeVllm

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


@pytest.mark.parametrize("fault", list(BROKEN))
async def test_an_unobservable_backend_gets_no_new_work_until_its_metrics_return(
    fault: str,
) -> None:
    async with start_gateway(n_backends=2) as h:
        b0, b1 = h.fakes["b0"], h.fakes["b1"]
        _break(b0, BROKEN[fault])
        await until(lambda: not h.gateway.scraper.states["b0"].healthy, timeout_s=10)  # type: ignore[union-attr]
        seen = b0.seen
        body = chat(stream=False, max_tokens=2)
        results = await asyncio.gather(*(h.client.post(CHAT, json=body) for _ in range(REQUESTS)))
        assert [r.status_code for r in results] == [200] * REQUESTS
        assert (b0.seen - seen, b1.completed) == (0, REQUESTS)  # the fakes' own counts
        state = (await h.client.get("/api/state")).json()["backends"]["b0"]
        assert state["healthy"] is False, state
        assert state["last_error"], state
        _break(b0, HEALED)
        await until(lambda: h.gateway.scraper.states["b0"].healthy, timeout_s=10)  # type: ignore[union-attr]
        results = await asyncio.gather(*(h.client.post(CHAT, json=body) for _ in range(REQUESTS)))
        assert [r.status_code for r in results] == [200] * REQUESTS
        assert b0.completed > 0  # traffic reaches it again
        await assert_back_to_zero(h.url, fakes_running(h.fakes.values()))


@pytest.mark.parametrize("fault", list(BROKEN))
async def test_with_no_observable_backend_requests_get_a_fast_503(fault: str) -> None:
    async with start_gateway() as h:
        _break(h.fake, BROKEN[fault])
        await until(lambda: not h.gateway.scraper.states["b0"].healthy, timeout_s=10)  # type: ignore[union-attr]
        results = await asyncio.gather(
            *(h.client.post(CHAT, json=chat(stream=s, max_tokens=2)) for s in [True, False] * 5)
        )
        for r in results:
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "no_healthy_backend"
            assert int(r.headers["retry-after"]) >= 1
        assert h.fake.seen == 0
        assert (await h.client.get("/healthz")).status_code == 200  # up, and says so
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
