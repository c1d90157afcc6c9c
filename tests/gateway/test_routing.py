"""Routing between backends, observed from outside: which fake vLLM saw each request, the most
each ran at once, and the body it got.

Covers: model pools (only a backend serving the model gets it, an alias reaches its model's
backends under the served name, an unknown model is a 404 before any backend is touched, and a
request waiting for a busy model never holds back one for another model); headroom ranking on
backends of unequal size, told apart from round robin (which, like first-fit, fills the small
one too); prefix routing sending a conversation back to the backend that served its start.
"""

from __future__ import annotations

import asyncio
import functools
from typing import TYPE_CHECKING

import pytest

from .harness import start_gateway, until

if TYPE_CHECKING:
    from .fake_vllm import FakeVllm

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
HELD = {"sla": {"ttft_ms": None}, "streaming": {"first_token_timeout_ms": None}}


def _new_bodies_are(fakes: dict[str, FakeVllm], before: dict[str, int], n: int) -> bool:
    return sum(len(f.bodies) - before[name] for name, f in fakes.items()) == n


def chat(model: str, content: str = "hi", max_tokens: int = 2) -> dict[str, object]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
    }


async def test_each_model_goes_only_to_its_backends() -> None:
    per_backend = {"b0": {"models": ["m-a"]}, "b1": {"models": ["m-b"]}}
    async with start_gateway(n_backends=2, per_backend=per_backend, models={"fast": "m-b"}) as h:
        b0, b1 = h.fakes["b0"], h.fakes["b1"]
        replies = [await h.client.post(CHAT, json=chat(m)) for m in ["m-a", "m-a", "fast", "m-b"]]
        assert [r.status_code for r in replies] == [200] * 4
        assert (b0.seen, b1.seen) == (2, 2)
        assert [b["model"] for b in b1.bodies] == ["m-b", "m-b"]  # the alias, as served
        unknown = await h.client.post(CHAT, json=chat("m-c"))
        assert unknown.status_code == 404
        assert unknown.json()["error"]["code"] == "model_not_found"
        assert (b0.seen, b1.seen) == (2, 2)
        listed = (await h.client.get("/v1/models")).json()["data"]
        assert sorted(m["id"] for m in listed) == ["fast", "m-a", "m-b"]


async def test_a_busy_model_never_holds_back_another() -> None:
    """m-a's one slot is held and a second m-a request waits; an m-b request behind it in time
    starts on its own backend at once and completes while m-a still waits."""
    per_backend = {"b0": {"models": ["m-a"]}, "b1": {"models": ["m-b"]}}
    gate = {"max_concurrency_per_gpu": 1}
    async with start_gateway(n_backends=2, per_backend=per_backend, gate=gate, **HELD) as h:
        b0, b1 = h.fakes["b0"], h.fakes["b1"]
        b0.default = {"step": True}
        held = [asyncio.create_task(h.client.post(CHAT, json=chat("m-a"))) for _ in range(2)]
        await until(lambda: b0.running == 1 and h.gateway.runtime.queued == 1)
        other = await asyncio.wait_for(h.client.post(CHAT, json=chat("m-b")), 5)
        assert other.status_code == 200
        assert (b0.seen, b1.seen, h.gateway.runtime.queued) == (1, 1, 1)
        b0.release(10)
        assert [r.status_code for r in await asyncio.gather(*held)] == [200, 200]
        assert b0.peak_running == 1


@pytest.mark.parametrize(("policy", "peaks"), [("least_loaded", [0, 4]), ("round_robin", [2, 2])])
async def test_headroom_prefers_the_larger_backend(policy: str, peaks: list[int]) -> None:
    """b0 has 2 slots, b1 has 8 (4 GPUs); 4 requests held at once. Headroom sends all 4 to b1
    (its room stays larger than b0's 2); round robin, like first-fit, puts 2 on the small b0."""
    per_backend = {"b1": {"gpus": 4}}
    async with start_gateway(
        n_backends=2,
        per_backend=per_backend,
        gate={"max_concurrency_per_gpu": 2},
        routing={"policy": policy},
        **HELD,
    ) as h:
        for fake in h.fakes.values():
            fake.default = {"step": True}
        tasks = [
            asyncio.create_task(h.client.post(CHAT, json=chat("fake-model"))) for _ in range(4)
        ]
        await until(lambda: sum(f.running for f in h.fakes.values()) == 4)
        assert [f.peak_running for f in h.fakes.values()] == peaks
        for fake in h.fakes.values():
            fake.release(10)
        assert [r.status_code for r in await asyncio.gather(*tasks)] == [200] * 4


@pytest.mark.parametrize("policy", ["prefix", "round_robin"])
async def test_prefix_routing_returns_a_conversation_to_its_backend(policy: str) -> None:
    """Three conversations, each with its own long opening; every turn resends the history, and
    each turn's three requests run at once. Under `prefix` the first turns spread over both
    backends by headroom, and each conversation's later turns reach the backend that served its
    start. The control: round robin moves every conversation (3 requests a turn on 2 backends)."""
    async with start_gateway(n_backends=2, routing={"policy": policy}, **HELD) as h:
        for fake in h.fakes.values():
            fake.default = {"step": True}
        opening = {c: f"conversation {c}: " + "context " * 200 for c in range(3)}
        where: dict[int, set[str]] = {c: set() for c in opening}
        for turn in range(3):
            history = " ".join(f"turn {t}" for t in range(turn + 1))
            before = {n: len(f.bodies) for n, f in h.fakes.items()}
            tasks = [
                asyncio.create_task(h.client.post(CHAT, json=chat("fake-model", text + history)))
                for text in opening.values()
            ]
            # The first turn's three run at once (step replies wait for permits); later turns
            # may find permits left over, and need not.
            await until(functools.partial(_new_bodies_are, h.fakes, before, 3))
            for name, fake in h.fakes.items():
                for body in fake.bodies[before[name] :]:
                    content = body["messages"][0]["content"]
                    where[int(content.split(":")[0].split()[1])].add(name)
                fake.release(10)
            assert [r.status_code for r in await asyncio.gather(*tasks)] == [200] * 3
        stayed = all(len(backends) == 1 for backends in where.values())
        used = set().union(*where.values())
        if policy == "prefix":
            assert stayed, where
            assert used == {"b0", "b1"}, where
        else:
            assert not stayed, where
