"""Operations surface: Prometheus metrics, health, readiness, the state snapshot, dashboard."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families

from .harness import Harness, start_gateway, until

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
BODY = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def test_metrics_count_outcomes_tokens_ttft_and_backend_state(gw: Harness) -> None:
    await gw.client.post(CHAT, json=BODY)
    await gw.client.post(CHAT, json={**BODY, "stream": True, "fake": {"itl": 0.05}})
    await gw.client.post(CHAT, json={**BODY, "model": "nope"})
    r = await gw.client.get("/metrics")
    assert r.headers["content-type"].startswith("text/plain")
    s = _samples(r.text)
    done = (
        "llmflow_requests_total",
        (("outcome", "completed"), ("reason", "completed"), ("tier", "normal")),
    )
    assert s[done] == 2
    assert s["llmflow_tokens_streamed_total", (("tier", "normal"),)] == 6
    assert s["llmflow_ttft_seconds_count", (("tier", "normal"),)] == 2
    assert s["llmflow_inter_chunk_seconds_count", ()] >= 1
    assert s["llmflow_in_flight", ()] == 0
    assert s["llmflow_backend_healthy", (("backend", "b0"),)] == 1
    assert s["llmflow_backend_kv_usage", (("backend", "b0"),)] == 0.0
    for name in (
        "llmflow_queue_total",
        "llmflow_kv_blocks_in_use",
        "llmflow_shed_level",
        "llmflow_draining",
    ):
        assert s[name, ()] == 0


async def test_rejections_truncations_and_aborts_are_counted() -> None:
    async with start_gateway(
        timeouts={"total_ms": 150}, gate={"max_concurrency_per_gpu": 1, "queue": {"max_waiting": 0}}
    ) as h:
        slow = asyncio.create_task(
            h.client.post(CHAT, json={**BODY, "max_tokens": 100, "fake": {"itl": 0.01}})
        )
        await until(lambda: h.fake.running != 0)
        assert (await h.client.post(CHAT, json=BODY)).status_code == 429
        assert (await slow).json()["llmflow"]["reason"] == "deadline"
        s = _samples((await h.client.get("/metrics")).text)
        assert (
            s[
                "llmflow_requests_total",
                (("outcome", "rejected"), ("reason", "queue_full"), ("tier", "normal")),
            ]
            == 1
        )
        assert (
            s[
                "llmflow_requests_total",
                (("outcome", "timeout"), ("reason", "deadline"), ("tier", "normal")),
            ]
            == 1
        )
        assert s["llmflow_truncations_total", (("reason", "deadline"),)] == 1
        assert s["llmflow_upstream_aborts_total", (("reason", "deadline"),)] == 1


async def test_healthz_readyz_and_state(gw: Harness) -> None:
    assert (await gw.client.get("/healthz")).json() == {"status": "ok"}
    assert (await gw.client.get("/health")).json() == {"status": "ok"}  # vLLM's name
    ready = await gw.client.get("/readyz")
    assert ready.status_code == 200
    assert ready.json()["healthy_backends"] == ["b0"]
    gw.fake.default = {"step": True}
    task = asyncio.create_task(gw.client.post(CHAT, json=BODY))
    await until(lambda: gw.fake.running != 0)
    state = (await gw.client.get("/api/state")).json()
    assert state["core"]["running"] == 1
    assert set(state["core"]["queued_by_tier"]) == {"vip", "normal", "batch"}
    (req,) = state["core"]["requests"]
    assert req["kv_blocks"] >= 1
    assert req["backend"] == "b0"
    assert state["backends"]["b0"]["healthy"] is True
    assert state["backends"]["b0"]["num_gpu_blocks"] == 1000
    assert [s["queued"] for s in state["streams"]] == [False]
    gw.fake.release(3)
    await task


async def test_dashboard_is_a_self_contained_page_polling_the_state(gw: Harness) -> None:
    r = await gw.client.get("/dashboard")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/html")
    assert 'fetch("api/state")' in r.text
    page = r.text.replace('"http://www.w3.org/2000/svg"', "")  # SVG's namespace, not a fetch
    assert "http://" not in page
    assert "https://" not in page
