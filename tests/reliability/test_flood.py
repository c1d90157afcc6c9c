"""The flood: 10,000 concurrent connections and a burst of 5,000 requests at a real gateway
process; and a gateway that runs out of file descriptors refuses politely.

Marked `reliability` (`make reliability`; `make test` leaves the flood out): it takes a
minute or two and most of a small machine. It measures, from the clients' side, how fast the
429s come (p99 under 50 ms when the burst arrives at `PACED_PER_S`; the all-at-once figure is
printed beside it), a VIP client's latency before and during the burst (the VIP in a process
of its own, `vip_probe.py`, as a VIP user is: timed from the flood's own loop, its answer would
also wait for that loop's thousands of crowd requests), and the gateway's
resident memory (`/proc/<pid>/status`), and prints them as one JSON line for
`docs/reliability.md`.
"""

from __future__ import annotations

import asyncio
import json
import resource
import statistics
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from tests.processes import GatewayProcess, SimServeProcess

from .flood import burst, chat_request, open_conns, percentile
from .vip_probe import Probe
from .zero import assert_back_to_zero, vllm_running

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.anyio

MODEL = "sim"
CONNECTIONS = 10_000  # idle connections held open through the burst
BURST = 5_000  # requests in the burst
PACED_PER_S = 1_000  # the paced burst's arrival rate
BEFORE, DURING = 1, 2  # the VIP probe's phases: a second before the bursts, then through them
P99_429_S = 0.050
RSS_LIMIT_MB = 1024


def _config(url: str) -> dict[str, Any]:
    return {
        # A hard bound of 32 waiting places: the flood is a flood of refusals (following the
        # drain, the queue would take most of the paced burst from the fast simulated vLLM).
        "gate": {
            "max_concurrency_per_gpu": 4,
            "queue": {"max_waiting": 32, "follow_drain": False},
        },
        "sla": {"ttft_ms": None},
        "metrics": {"scrape_interval_ms": 200},
        "streaming": {"sse_flush_interval": 0},
        "server": {"drain_timeout_ms": 1000},
        "tenants": [
            {"name": "gold", "tier": "vip", "api_keys": ["k-vip"]},
            {"name": "crowd", "tier": "normal", "api_keys": ["k-crowd"]},
        ],
        "backends": [{"name": "b0", "url": url, "models": [MODEL], "max_model_len": 8192}],
    }


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


async def _sample_rss(pid: int, peak: list[float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        peak[0] = max(peak[0], _rss_mb(pid))
        await asyncio.sleep(0.05)


@pytest.mark.reliability
async def test_a_flood_of_connections_and_requests(tmp_path: Path) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = CONNECTIONS + 1000
    assert hard >= need, f"the fd hard limit {hard} is below {need}: raise it (ulimit -Hn)"
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the test's side
    figures: dict[str, Any] = {}
    try:
        with (
            SimServeProcess(tmp_path, "--model-name", MODEL, "--speed", "4") as backend,
            GatewayProcess(_config(backend.url), tmp_path, max_open_files=hard) as gw,
        ):
            pid = gw.pid()
            async with httpx.AsyncClient(base_url=gw.url, timeout=60) as client:
                figures["rss_idle_mb"] = round(_rss_mb(pid), 1)
                probe = Probe(gw.port, chat_request("k-vip", MODEL), {0})
                probe.phase(BEFORE)
                await asyncio.sleep(1.0)
                probe.phase(0)
                conns = await open_conns(gw.port, CONNECTIONS)
                assert (await client.get("/healthz")).status_code == 200
                figures["rss_10k_connections_mb"] = round(_rss_mb(pid), 1)
                peak, stop = [0.0], asyncio.Event()
                sampler = asyncio.create_task(_sample_rss(pid, peak, stop))
                results: dict[str, list[tuple[int, float]]] = {}
                for name, per_s, part in (
                    ("all_at_once", None, conns[:BURST]),
                    ("paced", PACED_PER_S, conns[BURST : 2 * BURST]),
                ):
                    probe.phase(DURING)
                    results[name] = await burst(part, chat_request("k-crowd", MODEL), per_s)
                    probe.phase(0)
                    assert (await client.get("/healthz")).status_code == 200  # still up
                stop.set()
                await sampler
                vip = probe.stop()
                figures["rss_peak_mb"] = round(peak[0], 1)
                for conn in conns:
                    conn.writer.close()
                await assert_back_to_zero(gw.url, vllm_running([backend.url]), timeout_s=30)
                figures["rss_after_mb"] = round(_rss_mb(pid), 1)
            assert gw.stop() == 0
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    for name, answers in results.items():
        statuses = [s for s, _ in answers]
        refused = [t for s, t in answers if s == 429]
        assert set(statuses) <= {200, 429}, sorted(set(statuses))
        figures[name] = {
            "requests": len(answers),
            "served_200": statuses.count(200),
            "refused_429": len(refused),
            "p50_429_ms": round(percentile(refused, 0.50) * 1e3, 1),
            "p99_429_ms": round(percentile(refused, 0.99) * 1e3, 1),
        }
    baseline, vip_during = [t for _, t in vip[BEFORE]], [t for _, t in vip.get(DURING, [])]
    vip_statuses = {status for samples in vip.values() for status, _ in samples}
    assert vip_statuses == {200}, vip_statuses  # never refused, never failed
    assert vip_during, "no VIP request was answered during the flood"
    figures["vip_requests"] = {"before": len(baseline), "during": len(vip_during)}
    figures["vip_p50_ms"] = {
        "before": round(statistics.median(baseline) * 1e3, 1),
        "during": round(statistics.median(vip_during) * 1e3, 1),
    }
    figures["vip_max_ms"] = {
        "before": round(max(baseline) * 1e3, 1),
        "during": round(max(vip_during) * 1e3, 1),
    }
    print("\nFLOOD " + json.dumps(figures))
    assert figures["paced"]["p99_429_ms"] < P99_429_S * 1e3, figures
    assert figures["rss_peak_mb"] < RSS_LIMIT_MB, figures
    assert max(vip_during) < 2.0 + 3 * max(baseline), figures  # VIP kept its place


async def test_out_of_file_descriptors_refuses_politely_and_recovers(tmp_path: Path) -> None:
    """With 256 descriptors, 400 connections: the last get a 503 with Retry-After, an
    OpenAI-style body, and a closed connection; once they go, the gateway serves again."""
    with (
        SimServeProcess(tmp_path, "--model-name", MODEL, "--speed", "4") as backend,
        GatewayProcess(_config(backend.url), tmp_path, max_open_files=256) as gw,
    ):
        conns = await open_conns(gw.port, 400)
        request = chat_request("k-crowd", MODEL)
        results = await asyncio.wait_for(
            asyncio.gather(*(c.ask(request) for c in conns), return_exceptions=True),
            timeout=60,
        )
        statuses = [r[0] if isinstance(r, tuple) else type(r).__name__ for r in results]
        print("\nFD-LIMIT " + json.dumps({str(s): statuses.count(s) for s in set(statuses)}))
        assert statuses.count(503) > 0, statuses  # refused politely, not left in the backlog
        for conn in conns:
            conn.writer.close()
        async with httpx.AsyncClient(base_url=gw.url, timeout=30) as client:
            r = await client.post(
                "/v1/chat/completions",
                json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
                headers={"authorization": "Bearer k-vip"},
            )
            assert r.status_code == 200, r.text
            state = (await client.get("/api/state")).json()
            assert state["core"]["backends"][0]["healthy"], state  # not blamed on the backend
        await assert_back_to_zero(gw.url, vllm_running([backend.url]))
        assert gw.stop() == 0
