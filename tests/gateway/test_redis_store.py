"""`gateway/redis_store.py` against a real redis-server: the lease calls the runtime's `Lease`
and `Release` become. Counted with a plain Redis client, not through the store."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import pytest
import redis.asyncio as aioredis

from llmflow.gateway.redis_store import RedisStore

if TYPE_CHECKING:
    from processes import RedisProcess

pytestmark = pytest.mark.anyio

CAP = 3
KEY = "t:slots:b0"


async def _members(url: str) -> set[str]:
    client = aioredis.from_url(url)
    try:
        return {m.decode() for m in await client.zrange(KEY, 0, -1)}
    finally:
        await client.aclose()


async def test_the_cap_holds_and_a_release_frees_a_slot(redis_server: RedisProcess) -> None:
    client = aioredis.from_url(redis_server.url)
    store = RedisStore(client, "t", 5000)
    try:
        granted = [await store.acquire("b0", f"r:{i}", CAP) for i in range(CAP + 1)]
        assert granted == [True] * CAP + [False]
        await store.release("b0", ["r:0"])
        assert await store.acquire("b0", "r:9", CAP)
        assert await store.renew("b0", ["r:1"]) == CAP
    finally:
        await client.aclose()
    assert await _members(redis_server.url) == {"r:1", "r:2", "r:9"}


async def test_an_acquire_after_a_release_is_not_refused_for_the_released_slot(
    redis_server: RedisProcess,
) -> None:
    """The runtime gives a finished request's lease back before it asks for the next request's
    (`Release` before `Lease`), but the two calls travel on different connections of the pool.
    Here the release's connection is the slower one: its ZREM reaches Redis after the acquire.
    Before the acquire removed the leases still being released, every such acquire found the
    store full and was refused (200 of 200), and the freed slot stayed idle until the next
    sync: the replica fairness test's replica ran below its share."""
    client = aioredis.from_url(redis_server.url)
    zrem = client.zrem

    async def late_zrem(*args: Any) -> Any:
        await asyncio.sleep(0.005)
        return await zrem(*args)

    client.zrem = late_zrem  # type: ignore[method-assign]
    store = RedisStore(client, "t", 5000)
    refused = 0
    try:
        for i in range(CAP):
            assert await store.acquire("b0", f"r:{i}", CAP)
        for i in range(CAP, CAP + 20):
            release = asyncio.create_task(store.release("b0", [f"r:{i - CAP}"]))
            acquire = asyncio.create_task(store.acquire("b0", f"r:{i}", CAP))
            refused += not await acquire
            await release
    finally:
        await client.aclose()
    assert refused == 0
    assert await _members(redis_server.url) == {f"r:{i}" for i in range(20, CAP + 20)}
