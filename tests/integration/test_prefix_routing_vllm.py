"""Prefix routing against two real vLLM servers (CPU build): the prefix cache hit rate rises.

Multi-turn chats resend their history, so vLLM's prefix cache can serve a turn's leading
blocks, but only on the server that saw the earlier turns. `routing.policy: round_robin` moves
a conversation's turns between the two servers; `prefix` keeps each with the server holding
its blocks. The hit rate is read from outside: each vLLM's own `vllm:prefix_cache_hits_total`
over `vllm:prefix_cache_queries_total` (prompt tokens), before and after each run.
"""

from __future__ import annotations

import asyncio
import random
from typing import TYPE_CHECKING

import httpx
import pytest

from tests.integration.gateway_server import gateway_config
from tests.integration.gwtools import GatewayPool, wait_vllm_idle
from tests.integration.vllm_server import parse_metrics

if TYPE_CHECKING:
    from pathlib import Path

    from tests.integration.conftest import ServerFactory
    from tests.integration.vllm_server import VllmServer

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

CHATS = 5  # conversations, each with its own long system prompt (odd: round robin alternates)
TURNS = 4  # turns each; every turn resends the whole history
STAGGER_S = 0.02  # between the chats' requests of one turn


def _words(rng: random.Random, n: int) -> str:
    vocab = ["ledger", "invoice", "audit", "quarter", "margin", "forecast", "region", "supply"]
    return " ".join(rng.choice(vocab) for _ in range(n))


async def _counters(client: httpx.AsyncClient, servers: list[VllmServer]) -> tuple[float, float]:
    queries = hits = 0.0
    for server in servers:
        metrics = parse_metrics((await client.get(f"{server.url}/metrics")).text)
        queries += metrics.get("vllm:prefix_cache_queries_total", 0.0)
        hits += metrics.get("vllm:prefix_cache_hits_total", 0.0)
    return queries, hits


async def ask(client: httpx.AsyncClient, history: list[dict[str, str]], i: int) -> httpx.Response:
    """One turn of chat `i`, sent `STAGGER_S` after chat i-1's: the turns still overlap in vLLM,
    but reach the gateway in chat order, so round robin alternates each chat's server turn by
    turn (as racing requests it would sometimes send a chat back where its last turn is cached,
    and the two policies' rates would differ by chance)."""
    await asyncio.sleep(i * STAGGER_S)
    return await client.post(
        "/v1/chat/completions",
        json={"model": "tiny", "messages": history, "max_tokens": 8, "temperature": 0},
    )


async def _conversations(gateway: str, seed: int) -> None:
    """`CHATS` conversations side by side, turn after turn, through the gateway."""
    rng = random.Random(seed)
    histories: list[list[dict[str, str]]] = [
        [{"role": "system", "content": f"Case {seed}-{i}. " + _words(rng, 250)}]
        for i in range(CHATS)
    ]
    async with httpx.AsyncClient(base_url=gateway, timeout=120) as client:
        for turn in range(TURNS):
            for history in histories:
                history.append({"role": "user", "content": f"Turn {turn}: " + _words(rng, 20)})
            replies = await asyncio.gather(*(ask(client, h, i) for i, h in enumerate(histories)))
            for history, reply in zip(histories, replies, strict=True):
                assert reply.status_code == 200, reply.text
                text = reply.json()["choices"][0]["message"]["content"] or "ok"
                history.append({"role": "assistant", "content": text})


def test_prefix_routing_raises_vllms_prefix_cache_hit_rate(
    vllm_server: VllmServer, vllm_server_factory: ServerFactory, tmp_path: Path
) -> None:
    first = vllm_server
    wait_vllm_idle(first)
    second = vllm_server_factory(())
    servers = [first, second]
    base = gateway_config(first.url)["backends"][0]
    rates: dict[str, float] = {}
    with GatewayPool.running(tmp_path) as pool:
        for seed, policy in enumerate(("round_robin", "prefix")):
            config = gateway_config(
                first.url,
                backends=[{**base, "name": f"v{i}", "url": s.url} for i, s in enumerate(servers)],
                routing={"policy": policy},
                sla={"ttft_ms": None},
            )
            gw = pool.start(config)

            async def run(gateway_url: str, seed: int) -> float:
                async with httpx.AsyncClient(timeout=10) as client:
                    q0, h0 = await _counters(client, servers)
                    # A fresh set of system prompts per policy: nothing cached from the other.
                    await _conversations(gateway_url, 100 + seed)
                    q1, h1 = await _counters(client, servers)
                assert q1 - q0 > 0, "vLLM counted no prefix-cache queries"
                return (h1 - h0) / (q1 - q0)

            rates[policy] = asyncio.run(run(gw.url, seed))
            gw.stop()
    print(f"prefix-cache hit rate: {rates}")
    # Round robin alternates each chat's server: a turn finds cached only the history up to two
    # turns back (turn 1: none of it). Prefix routing keeps each chat where its blocks are.
    assert rates["prefix"] > rates["round_robin"] + 0.15, rates
    assert rates["prefix"] > 0.5, rates
