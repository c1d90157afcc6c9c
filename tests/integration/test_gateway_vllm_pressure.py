"""The gateway's tiers against real vLLM under pressure: vLLM priorities, preemption shedding.

One vLLM server for this module, started with `--scheduling-policy priority`, 8 seats
(`--max-num-seqs`) and a 4 MiB KV cache (32 blocks of 128 tokens on CPU, 31 usable), so both a
full batch and KV exhaustion are a few requests away. Two tenants: `gold` (tier `vip`,
protected) and `shop` (tier `normal`).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from tests.integration.gateway_server import gateway_config
from tests.integration.gwtools import StreamLog, body, cancel, gateway_idle, poll, stream_into
from tests.integration.gwtools import wait_vllm_idle as wait_idle
from tests.integration.vllm_server import parse_metrics

if TYPE_CHECKING:
    from collections.abc import Callable

    from tests.integration.gateway_server import GatewayProcess
    from tests.integration.vllm_server import VllmServer

pytestmark = pytest.mark.integration

TIGHT_ARGS = ("--scheduling-policy", "priority", "--kv-cache-memory-bytes", str(4 << 20),
              "--max-num-seqs", "8")
SEATS = 8  # vLLM's --max-num-seqs here
VIP_TOKENS = 1500  # long enough to be running when vLLM starts preempting the flood
FILLER = (16, 368)  # prompt, output: 384 tokens = 3 of the 31 usable blocks, 8 fit together
VIP, NORMAL = {"Authorization": "Bearer k-gold"}, {"Authorization": "Bearer k-shop"}
TENANTS = [
    {"name": "gold", "tier": "vip", "api_keys": ["k-gold"]},
    {"name": "shop", "tier": "normal", "api_keys": ["k-shop"]},
]
QUIET = {  # no shedding but what a test turns on: the order comes from vLLM alone
    "kv": {"pressure_threshold": None, "fit_target": None},
    "sla": {"ttft_ms": None},
    "preemption": {"cooldown_ms": None},
    "streaming": {"sse_flush_interval": 0, "first_token_timeout_ms": None},
}


@pytest.fixture(scope="module")
def tight(vllm_server_factory: Callable[[Any], VllmServer]) -> VllmServer:
    """vLLM with priority scheduling and 32 KV blocks (shared by this module)."""
    return vllm_server_factory(TIGHT_ARGS)


async def _metrics(client: httpx.AsyncClient, server: VllmServer) -> dict[str, float]:
    response = await client.get(f"{server.url}/metrics")
    response.raise_for_status()
    return parse_metrics(response.text)


async def _until(client: httpx.AsyncClient, server: VllmServer, name: str, value: float,
                 timeout_s: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while (await _metrics(client, server))[name] != value:
        assert loop.time() < deadline, f"{name} never reached {value}"
        await asyncio.sleep(0.01)


async def _admission_order(server: VllmServer, gw: GatewayProcess) -> list[str]:
    """Eight normal fillers take every vLLM seat, then three normal requests and one VIP queue
    in vLLM, in that order. One filler is then cut: the four short requests go through that
    one seat, one after the other, in the order vLLM picks them. Returns who got a first token,
    in order."""
    url = f"{gw.openai_base_url}/completions"
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client, httpx.AsyncClient() as m:
        fillers = [asyncio.create_task(stream_into(client, url, body(*FILLER), StreamLog(), NORMAL))
                   for _ in range(SEATS)]
        await _until(m, server, "vllm:num_requests_running", SEATS, 20)
        logs = {name: StreamLog() for name in ("normal-1", "normal-2", "normal-3", "vip")}
        waiters = []
        for n, (name, log) in enumerate(logs.items()):
            headers = VIP if name == "vip" else NORMAL
            waiters.append(asyncio.create_task(stream_into(client, url, body(16, 8), log, headers)))
            await _until(m, server, "vllm:num_requests_waiting", n + 1, 5)
        await cancel(fillers[0])  # one seat frees: the four pass through it one after another
        await asyncio.wait_for(asyncio.gather(*waiters), 20)
        for filler in fillers[1:]:
            await cancel(filler)
    assert all(log.tokens == 8 for log in logs.values()), {k: v.tokens for k, v in logs.items()}
    return sorted(logs, key=lambda name: logs[name].first_token)


def test_vip_queued_in_vllm_starts_first(tight: VllmServer, start_gateway: Any) -> None:
    """With `scheduling_policy: priority` the gateway sends the core's priority and vLLM gives
    the first free seat to the VIP, although three normal requests were waiting before it."""
    wait_idle(tight)
    gw = start_gateway(gateway_config(tight.url, priority=True, tenants=TENANTS,
                                      gate={"max_concurrency_per_gpu": 32}, **QUIET))
    order = asyncio.run(_admission_order(tight, gw))
    assert order[0] == "vip", order
    assert order[1:] == ["normal-1", "normal-2", "normal-3"], order
    poll(lambda: gateway_idle(gw.state()), 3.0)


def test_without_priorities_vllm_serves_in_arrival_order(
    tight: VllmServer, start_gateway: Any
) -> None:
    """The control: the same run with `scheduling_policy: fcfs` (no priority sent) leaves the
    VIP behind the three normal requests that arrived first."""
    wait_idle(tight)
    gw = start_gateway(gateway_config(tight.url, priority=False, tenants=TENANTS,
                                      gate={"max_concurrency_per_gpu": 32}, **QUIET))
    order = asyncio.run(_admission_order(tight, gw))
    assert order == ["normal-1", "normal-2", "normal-3", "vip"], order


def test_preemptions_shed_normal_while_vip_completes(
    tight: VllmServer, start_gateway: Any
) -> None:
    """Seven long normal requests and one VIP request run together; the normal ones outgrow
    vLLM's 31 usable KV blocks and it preempts them (never the VIP: its priority is better).
    The gateway sees `num_preemptions_total` rise and refuses new normal requests with 429
    (its preemption breaker halves the normal tier's 12 slots, which the 8 running exceed),
    while the VIP request runs to completion. KV-pressure shedding, the KV fit (which would
    never let the flood outgrow the cache) and prefill pacing are off, so the refusals can only
    be the breaker's."""
    wait_idle(tight)
    gw = start_gateway(gateway_config(
        tight.url, priority=True, tenants=TENANTS,
        gate={"max_concurrency_per_gpu": 12, "queue": {"max_waiting": 2},
              "headroom_quantile": None},  # no prefill pacing: the flood must start at once
        kv={"pressure_threshold": None, "fit_target": None},  # vLLM must be let preempt
        preemption={"cooldown_ms": 10_000},
        streaming={"sse_flush_interval": 0, "first_token_timeout_ms": None},
        sla={"ttft_ms": None}))
    url = f"{gw.openai_base_url}/completions"

    async def scenario() -> tuple[float, list[StreamLog], StreamLog]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(timeout=120, limits=limits) as c, httpx.AsyncClient() as m:
            before = (await _metrics(m, tight))["vllm:num_preemptions_total"]
            flood = [asyncio.create_task(stream_into(c, url, body(500, 1000), StreamLog(), NORMAL))
                     for _ in range(SEATS - 1)]  # 7 x 1,500 tokens: 2.6 times the cache
            vip = asyncio.create_task(stream_into(c, url, body(32, VIP_TOKENS), StreamLog(), VIP))
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 30
            while (await _gateway_preemptions(m, gw)) <= 0:
                assert loop.time() < deadline, "the gateway never saw a preemption"
                assert not vip.done(), "the VIP request ended before any preemption"
                await asyncio.sleep(0.05)
            after = (await _metrics(m, tight))["vllm:num_preemptions_total"]
            shed = [await stream_into(c, url, body(32, 16), StreamLog(), NORMAL)
                    for _ in range(3)]
            await asyncio.wait_for(vip, 60)
            for task in flood:
                await cancel(task)
            return after - before, shed, vip.result()

    preempted, shed, vip = asyncio.run(scenario())
    assert preempted > 0
    assert [log.status for log in shed] == [429, 429, 429], [log.error for log in shed]
    reasons = [log.error["code"] if log.error else None for log in shed]
    assert reasons == ["preemption_breaker"] * 3, reasons
    assert all(int(log.headers["retry-after"]) >= 1 for log in shed)
    assert vip.status == 200, vip.error
    assert vip.tokens == VIP_TOKENS
    poll(lambda: gateway_idle(gw.state()), 5.0)
    wait_idle(tight)
    print(f"vLLM preempted {preempted:.0f} times; normal refused with {reasons[0]}; VIP "
          f"completed {VIP_TOKENS} tokens in {vip.done - vip.sent:.2f} s")


async def _gateway_preemptions(client: httpx.AsyncClient, gw: GatewayProcess) -> int:
    """Preemptions the gateway's core has counted from its scrapes of vLLM."""
    state = (await client.get(f"{gw.url}/api/state")).json()
    return int(sum(b["preemptions"] for b in state["core"]["backends"]))
