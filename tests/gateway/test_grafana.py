"""The Grafana dashboard (`deploy/grafana/llmflow.json`) queries only metrics the gateway exports.

The exported names come from a running gateway's `/metrics`, scraped over HTTP after it has
served and refused a request: its samples, and the series each `# TYPE` line implies.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import openai
import pytest

from .harness import SIM_MODEL, start_gateway, start_sim_gateway, until

pytestmark = pytest.mark.anyio

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "llmflow.json"
KEY = "ak-grafana-test-tenant-01"
_METRIC = re.compile(r"\b(?:llmflow_|vllm:)[A-Za-z0-9_:]*")
_SERIES = {  # the series a family of each type exposes (prometheus_client's text format)
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
}


def _expressions(dashboard: dict[str, object]) -> list[str]:
    exprs = []
    for panel in dashboard["panels"]:  # type: ignore[attr-defined]
        exprs += [t["expr"] for t in panel.get("targets", ())]
    return exprs


def _exported(text: str) -> set[str]:
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, family, kind = line.split(" ", 3)
            names.update(family + suffix for suffix in _SERIES.get(kind, ("",)))
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


async def test_every_dashboard_query_names_an_exported_metric() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    tenants = [{"name": "t", "tier": "normal", "api_keys": [KEY], "requests_per_s": 0.01}]
    async with start_sim_gateway(tenants=tenants) as h:
        async with openai.AsyncOpenAI(base_url=h.url + "/v1", api_key=KEY, max_retries=0) as c:
            t0 = time.monotonic()
            await c.completions.create(model=SIM_MODEL, prompt="hi", max_tokens=4)
            took = time.monotonic() - t0
            with pytest.raises(openai.RateLimitError):  # a refusal, counted by reason
                await c.completions.create(model=SIM_MODEL, prompt="hi", max_tokens=4)
        scraper = h.gateway.scraper
        assert scraper is not None
        await until(lambda: scraper.states["sim0"].preemptions_total is not None)
        text = (await h.client.get("/metrics")).text
    # the one completed request, in the new end-to-end histogram, no longer than the client saw
    assert 'llmflow_e2e_seconds_count{tier="normal"} 1.0' in text
    e2e = re.search(r'llmflow_e2e_seconds_sum\{tier="normal"\} (\S+)', text)
    assert e2e is not None
    assert 0 < float(e2e.group(1)) <= took
    exported = _exported(text)
    exprs = _expressions(dashboard)
    assert len(exprs) >= 15
    for expr in exprs:
        named = set(_METRIC.findall(expr))
        assert named, f"{expr!r} names no llmflow metric"
        assert named <= exported, f"{expr!r}: not exported: {sorted(named - exported)}"
        assert expr.count("(") == expr.count(")"), expr


def test_the_dashboard_has_the_panels_the_docs_promise() -> None:
    titles = [p["title"] for p in json.loads(DASHBOARD.read_text())["panels"]]
    for wanted in (
        "TTFT p50 / p99 by tier",
        "End-to-end p50 / p99 by tier",
        "Queue by tier",
        "In flight by tier",
        "Refusals by reason",
        "KV cache usage by backend",
        "Preemptions by backend",
        "Prefix cache hit rate per backend",
    ):
        assert wanted in titles


async def test_an_idle_gateway_exports_every_tier_at_zero() -> None:
    # The "Queue by tier" and "In flight by tier" panels show "no data" rather than 0 unless
    # each configured tier has a sample while nothing waits or runs.
    async with start_sim_gateway() as h:
        text = (await h.client.get("/metrics")).text
        tiers = [t.name for t in h.gateway.settings.tiers]
    assert len(tiers) >= 2
    for family in ("llmflow_queue_length", "llmflow_tier_in_flight"):
        samples = dict(re.findall(rf'^{family}\{{tier="([^"]+)"\}} (\S+)$', text, re.M))
        assert samples == dict.fromkeys(tiers, "0.0"), family


def _per_tier(text: str, family: str) -> dict[str, str]:
    return dict(re.findall(rf'^{family}\{{tier="([^"]+)"\}} (\S+)$', text, re.M))


async def test_configured_tiers_read_zero_idle_count_under_load_and_zero_once_drained() -> None:
    # Tiers of the config's own names: each has a 0 sample before any request; while one
    # request runs and one waits (its tier's), they count; once both end, 0 again.
    tiers = [{"name": "gold", "protected": True}, {"name": "silver"}, {"name": "bronze"}]
    tenants = [{"name": "s", "tier": "silver", "api_keys": ["ks"]}]
    async with start_gateway(
        tiers=tiers, default_tier="silver", tenants=tenants, gate={"max_concurrency_per_gpu": 1}
    ) as h:
        zero = dict.fromkeys(["gold", "silver", "bronze"], "0.0")
        idle = (await h.client.get("/metrics")).text
        assert _per_tier(idle, "llmflow_queue_length") == zero
        assert _per_tier(idle, "llmflow_tier_in_flight") == zero
        body = {"model": "fake-model", "prompt": "hi", "max_tokens": 1, "fake": {"step": True}}
        key = {"authorization": "Bearer ks"}
        running = asyncio.create_task(h.client.post("/v1/completions", json=body, headers=key))
        await until(lambda: h.fake.running == 1)
        queued = asyncio.create_task(h.client.post("/v1/completions", json=body, headers=key))
        await until(lambda: h.gateway.runtime.queued == 1)
        busy = (await h.client.get("/metrics")).text
        assert _per_tier(busy, "llmflow_queue_length") == {**zero, "silver": "1.0"}
        assert _per_tier(busy, "llmflow_tier_in_flight") == {**zero, "silver": "1.0"}
        h.fake.release(2)
        assert [(await t).status_code for t in (running, queued)] == [200, 200]
        await h.settle()
        drained = (await h.client.get("/metrics")).text
        assert _per_tier(drained, "llmflow_queue_length") == zero
        assert _per_tier(drained, "llmflow_tier_in_flight") == zero
