"""Identity and tiers come from API keys only; no header can raise a client's tier."""

from __future__ import annotations

import asyncio

import pytest

from .harness import Harness, start_gateway, until

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
TENANTS = [
    {"name": "acme", "tier": "vip", "api_keys": ["vip-key"]},
    {"name": "bulk", "tier": "normal", "api_keys": ["normal-key", "normal-key-2"]},
]
BODY = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


def _auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def test_missing_or_unknown_key_is_401_when_keys_are_configured() -> None:
    async with start_gateway(tenants=TENANTS) as h:
        for headers in ({}, _auth("wrong"), {"authorization": "Basic dmlwLWtleQ=="}):
            r = await h.client.post(CHAT, json=BODY, headers=headers)
            assert r.status_code == 401
            assert r.json()["error"]["code"] == "invalid_api_key"
            assert r.headers["www-authenticate"] == "Bearer"
        assert (await h.client.get("/v1/models")).status_code == 401
        assert (await h.client.post(CHAT, json=BODY, headers=_auth("vip-key"))).status_code == 200
        assert h.fake.seen == 1


async def test_without_keys_everyone_is_the_anonymous_default_tier(gw: Harness) -> None:
    gw.fake.default = {"step": True}
    task = asyncio.create_task(gw.client.post(CHAT, json=BODY, headers=_auth("anything")))
    await until(lambda: gw.fake.running != 0)
    (stream,) = (await gw.client.get("/api/state")).json()["streams"]
    assert (stream["tenant"], stream["tier"]) == ("anonymous", "normal")
    gw.fake.release()
    assert (await task).status_code == 200


async def test_x_user_tier_cannot_raise_a_tier() -> None:
    """Queue of 5, normal shed above 80%: a normal key is shed even when it claims VIP."""
    async with start_gateway(
        tenants=TENANTS, gate={"max_concurrency_per_gpu": 1, "queue": {"max_waiting": 5}}
    ) as h:
        h.fake.default = {"step": True}
        tasks = [asyncio.create_task(h.client.post(CHAT, json=BODY, headers=_auth("vip-key")))]
        await until(lambda: h.fake.running != 0)
        for _ in range(4):  # queue 4 of 5: 80% full
            tasks.append(
                asyncio.create_task(h.client.post(CHAT, json=BODY, headers=_auth("normal-key")))
            )
        await until(lambda: not (h.gateway.runtime.queued < 4))
        claimed = await h.client.post(
            CHAT, json=BODY, headers={**_auth("normal-key-2"), "x-user-tier": "vip"}
        )
        assert claimed.status_code == 429
        assert claimed.json()["error"]["code"] == "tier_shed"
        tasks.append(asyncio.create_task(h.client.post(CHAT, json=BODY, headers=_auth("vip-key"))))
        await until(lambda: not (h.gateway.runtime.queued < 5))
        tiers = sorted(s["tier"] for s in (await h.client.get("/api/state")).json()["streams"])
        assert tiers == ["normal"] * 4 + ["vip"] * 2
        h.fake.release(6)
        assert [r.status_code for r in await asyncio.gather(*tasks)] == [200] * 6


async def test_the_cores_priority_goes_to_a_priority_scheduling_backend() -> None:
    async with start_gateway(tenants=TENANTS, backend={"scheduling_policy": "priority"}) as h:
        for key in ("normal-key", "vip-key"):
            body = {**BODY, "priority": -1000}  # a client's own priority is never forwarded
            assert (await h.client.post(CHAT, json=body, headers=_auth(key))).status_code == 200
        normal, vip = (b["priority"] for b in h.fake.bodies)
        assert vip < normal  # lower runs first in vLLM
        assert -1000 not in (normal, vip)


async def test_no_priority_is_sent_to_a_fcfs_backend(gw: Harness) -> None:
    await gw.client.post(CHAT, json={**BODY, "priority": 5})
    assert "priority" not in gw.fake.bodies[-1]
