"""Brownout before refusal: under queue pressure a tier's answers get shorter, not refused."""

from __future__ import annotations

import asyncio

import pytest

from .harness import start_gateway, until

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
TIERS = [
    {"name": "vip", "protected": True},
    {"name": "normal", "shed_at": 1.0, "brownout_at": 0.25, "brownout_max_tokens": 7},
]


async def test_a_pressed_tier_is_sent_upstream_with_max_tokens_clamped() -> None:
    """One slot, four waiting places, brownout from one waiting: the first two requests go
    upstream as asked, every later one with max_tokens 7 (max_completion_tokens where the
    client used it), as the fake vLLM received them."""
    async with start_gateway(
        tiers=TIERS,
        default_tier="normal",
        gate={"max_concurrency_per_gpu": 1, "queue": {"max_waiting": 4}},
    ) as h:
        h.fake.default = {"step": True}
        one = {"fake": {"tokens": 1}}  # each reply is one token: one release() ends it
        chat = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], **one}
        bodies = [
            {**chat, "max_tokens": 50, "stream": True},  # runs at once
            {**chat, "max_tokens": 50, "stream": True},  # waits: the queue was empty
            {**chat, "max_completion_tokens": 50, "stream": True},  # 1 of 4 waiting: clamped
            {"model": "fake-model", "prompt": "hi", "max_tokens": 50, "stream": True, **one},
        ]
        paths = [CHAT, CHAT, CHAT, COMPLETIONS]
        tasks = []
        for i, (path, body) in enumerate(zip(paths, bodies, strict=True)):
            tasks.append(asyncio.create_task(h.client.post(path, json=body)))
            await until(lambda n=i: h.fake.running + h.gateway.runtime.queued == n + 1)
        for _ in range(4):
            await until(lambda: h.fake.running == 1)
            h.fake.release()
        assert [r.status_code for r in await asyncio.gather(*tasks)] == [200] * 4
        sent = h.fake.bodies
        assert [b.get("max_tokens") for b in sent] == [50, 50, None, 7]
        assert sent[2]["max_completion_tokens"] == 7
        state = (await h.client.get("/api/state")).json()
        assert state["core"]["counters"]["browned_out"] == 2
