"""Backend scrapes: vLLM's metric names old and new, health from failures, stale metrics,
multi-backend routing."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import httpx
import pytest

from llmflow.gateway.scraper import NotMetricsError, parse_vllm_metrics
from llmflow.gateway.shared_scrape import ScrapedElsewhereError, answered

from .harness import start_gateway, until

if TYPE_CHECKING:
    from .fake_vllm import FakeVllm

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
BODY = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}

VLLM_TEXT = """\
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="tiny"} 0.5
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
vllm:num_requests_running{engine="1",model_name="tiny"} 4.0
vllm:num_requests_waiting{engine="0",model_name="a b}"} 2.0
vllm:num_preemptions_total{engine="0",model_name="tiny"} 7.0 1700000000
vllm:num_preemptions_created{engine="0",model_name="tiny"} 1.7e9
vllm:cache_config_info{block_size="16",num_gpu_blocks="4096",engine="0"} 1.0
vllm:time_to_first_token_seconds_bucket{le="0.001"} 0.0
"""


def test_parse_takes_the_max_kv_and_sums_counts() -> None:
    assert parse_vllm_metrics(VLLM_TEXT) == {
        "kv_usage": 0.5,
        "running": 7.0,
        "waiting": 2.0,
        "preemptions_total": 7.0,
        "num_gpu_blocks": 4096.0,
        "block_size": 16.0,
    }


def test_parse_accepts_the_older_gpu_cache_name_and_prefers_the_new_one() -> None:
    old = 'vllm:gpu_cache_usage_perc{engine="0"} 0.75\n'
    assert parse_vllm_metrics(old) == {"kv_usage": 0.75}
    both = old + 'vllm:kv_cache_usage_perc{engine="0"} 0.1\n'
    assert parse_vllm_metrics(both)["kv_usage"] == 0.1
    assert parse_vllm_metrics("garbage\nvllm:num_requests_running{} nan?\n") == {}


async def test_scrapes_feed_the_core_and_the_old_kv_name_works() -> None:
    def configure(fakes: dict[str, FakeVllm]) -> None:
        fakes["b0"].kv_name = "vllm:gpu_cache_usage_perc"
        fakes["b0"].kv_usage = 0.42

    async with start_gateway(configure=configure) as h:
        backend = h.gateway.runtime.snapshot(0)["backends"][0]
        assert backend["kv_usage"] == pytest.approx(0.42)
        assert backend["kv_capacity_blocks"] == 1000  # learned from cache_config_info


async def test_a_backend_whose_metrics_fail_stays_up_and_says_why() -> None:
    """A 500 from `/metrics` comes from a live server: the backend stays up (the stale rule,
    tested in tests/reliability/test_broken_metrics.py, holds it to half its slots) and
    `/api/state` shows the failure; only a backend nothing answers is taken down
    (tests/reliability/test_backend_killed.py)."""
    async with start_gateway(n_backends=2) as h:
        b0, b1 = h.fakes["b0"], h.fakes["b1"]
        b0.metrics_status = 500
        await until(lambda: h.gateway.scraper.states["b0"].failures >= 3)  # type: ignore[union-attr]
        results = await asyncio.gather(*(h.client.post(CHAT, json=BODY) for _ in range(6)))
        assert [r.status_code for r in results] == [200] * 6
        assert b0.seen + b1.seen == 6
        state = (await h.client.get("/api/state")).json()["backends"]
        assert state["b0"]["healthy"] is True
        assert "500" in state["b0"]["last_error"]
        assert (await h.client.get("/readyz")).json()["healthy_backends"] == ["b0", "b1"]
        b0.metrics_status = 200
        await until(lambda: h.gateway.scraper.states["b0"].failures == 0)  # type: ignore[union-attr]


async def test_stale_metrics_halve_the_slots_until_a_fresh_scrape() -> None:
    """Scrapes a minute apart but stale after 300 ms: once the last scrape is stale the backend
    gets half its slots, so the fake never runs more than 2 of 4 held requests; a fresh scrape
    lets the other 2 in. Counted by the fake, not the gateway."""
    cap = 4
    async with start_gateway(
        gate={"max_concurrency_per_gpu": cap, "queue": {"max_waiting": 8}},
        metrics={"scrape_interval_ms": 60_000, "stale_after_ms": 300},
        sla={"ttft_ms": None},
        streaming={"first_token_timeout_ms": None},
    ) as h:
        fake = h.fake
        await until(lambda: fake.metrics_scrapes == 2)  # the start's scrape and the loop's first
        await asyncio.sleep(0.5)  # no scrape for longer than stale_after_ms
        fake.default = {"step": True}
        body = {**BODY, "max_tokens": 2}
        tasks = [asyncio.create_task(h.client.post(CHAT, json=body)) for _ in range(cap)]
        await until(lambda: fake.running >= cap // 2)
        await asyncio.sleep(0.3)  # time for a third or fourth to (wrongly) start
        assert (fake.seen, fake.peak_running) == (cap // 2, cap // 2)
        assert fake.metrics_scrapes == 2
        await h.gateway.scraper.scrape_all()  # type: ignore[union-attr]
        await until(lambda: fake.running == cap)
        assert (fake.seen, fake.peak_running) == (cap, cap)
        fake.release(2 * cap)
        assert [r.status_code for r in await asyncio.gather(*tasks)] == [200] * cap


async def test_fresh_metrics_give_the_full_cap() -> None:
    """The control: with scrapes fresh, the same 4 held requests all run at once."""
    cap = 4
    async with start_gateway(
        gate={"max_concurrency_per_gpu": cap},
        sla={"ttft_ms": None},
        streaming={"first_token_timeout_ms": None},
    ) as h:
        h.fake.default = {"step": True}
        body = {**BODY, "max_tokens": 2}
        tasks = [asyncio.create_task(h.client.post(CHAT, json=body)) for _ in range(cap)]
        await until(lambda: h.fake.running == cap)
        assert h.fake.peak_running == cap
        h.fake.release(2 * cap)
        assert [r.status_code for r in await asyncio.gather(*tasks)] == [200] * cap


async def test_load_spreads_to_the_backend_with_headroom() -> None:
    async with start_gateway(n_backends=2, gate={"max_concurrency_per_gpu": 2}) as h:
        for fake in h.fakes.values():
            fake.default = {"step": True}
        tasks = [asyncio.create_task(h.client.post(CHAT, json=BODY)) for _ in range(4)]
        await until(lambda: not (sum(f.running for f in h.fakes.values()) < 4))
        assert [f.running for f in h.fakes.values()] == [2, 2]
        for fake in h.fakes.values():
            fake.release(2)
        assert [r.status_code for r in await asyncio.gather(*tasks)] == [200] * 4


async def test_all_backends_down_fails_fast_with_503() -> None:
    async with start_gateway() as h:
        h.fake.metrics_status = 503
        await until(lambda: not h.gateway.scraper.states["b0"].healthy)  # type: ignore[union-attr]
        r = await h.client.post(CHAT, json=BODY)
        assert r.status_code == 503
        assert r.json()["error"]["code"] == "no_healthy_backend"
        assert (await h.client.get("/readyz")).status_code == 503
        assert h.fake.seen == 0


@pytest.mark.parametrize(
    ("status", "reachable"), [(500, True), (404, True), (502, False), (503, False), (504, False)]
)
def test_a_failed_scrape_is_judged_by_whether_the_server_answered(
    status: int, reachable: bool
) -> None:
    """An error status from vLLM itself means it is alive (up, at the stale rule's half);
    a proxy's 502-504 or no connection at all means nothing answered (towards down)."""
    request = httpx.Request("GET", "http://b0/metrics")
    response = httpx.Response(status, request=request)
    error = httpx.HTTPStatusError("scrape", request=request, response=response)
    assert answered(error) is reachable
    assert answered(httpx.ConnectError("refused", request=request)) is False
    assert answered(httpx.ConnectTimeout("no answer", request=request)) is False
    assert answered(httpx.ReadTimeout("slow", request=request)) is True
    assert answered(NotMetricsError("<html>")) is True
    assert answered(ScrapedElsewhereError("elsewhere", reachable)) is reachable
