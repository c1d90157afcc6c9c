"""The Rust relay from outside: usage as asked, keep-alive, several threads.

Every streamed completion runs through the relay (the front serves them all); these check
what is particular to it. Its bytes against the Python path's, recorded, are
`test_front_native.py`'s.
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any

import pytest

from .harness import assert_idle, start_gateway

if TYPE_CHECKING:
    import httpx

pytestmark = pytest.mark.anyio
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def _events(text: str) -> list[Any]:
    out: list[Any] = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            data = block[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def _comparable(events: list[Any]) -> list[Any]:
    """What a client reads, minus the per-request fields (ids, timestamps)."""
    out = []
    for event in events:
        if isinstance(event, dict):
            event = {k: v for k, v in event.items() if k not in ("id", "created")}
        out.append(event)
    return out


async def _stream(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> tuple[int, str]:
    async with client.stream("POST", path, json=body) as r:
        text = (await r.aread()).decode()
        return r.status_code, text


@pytest.mark.parametrize(
    ("path", "extra"),
    [
        (CHAT, {}),
        (CHAT, {"stream_options": {"include_usage": True}}),
        (COMPLETIONS, {}),
        (COMPLETIONS, {"stream_options": {"include_usage": True}}),
    ],
)
async def test_the_relay_sends_usage_as_the_client_asked(path: str, extra: dict[str, Any]) -> None:
    body: dict[str, Any] = {"model": "fake-model", "stream": True, "max_tokens": 6, **extra}
    if path == CHAT:
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    async with start_gateway() as h:
        status, text = await _stream(h.client, path, body)
        assert status == 200, text
        relayed = _comparable(_events(text))
        assert h.fake.completed == 1
    assert relayed[-1] == "[DONE]"
    texts = [
        c.get("text") or (c.get("delta") or {}).get("content") or ""
        for e in relayed
        if isinstance(e, dict)
        for c in e["choices"]
    ]
    assert len([t for t in texts if t]) == 6  # each of vLLM's six tokens, in its own chunk
    usage = [e.get("usage") for e in relayed if isinstance(e, dict)]
    if extra:
        assert usage[-1]["completion_tokens"] == 6  # the final usage chunk, as vLLM sends it
        assert all(u is None for u in usage[:-1])
    else:
        assert usage == [None] * len(usage)  # continuous usage never reaches the client


async def test_a_keep_alive_connection_serves_requests_after_a_relayed_reply() -> None:
    body = {
        "model": "fake-model",
        "stream": True,
        "max_tokens": 3,
        "messages": [{"role": "user", "content": "hi"}],
    }
    connections: list[int] = []

    async def count(response: httpx.Response) -> None:
        connections.append(id(response.extensions["network_stream"]))

    async with start_gateway() as h:
        h.client.event_hooks["response"].append(count)
        for _ in range(3):
            status, text = await _stream(h.client, CHAT, body)
            assert status == 200
            assert text.endswith("data: [DONE]\n\n")
            r = await h.client.get("/v1/models")  # a plain route on the same connection
            assert r.status_code == 200
        assert h.fake.completed == 3
        assert len(connections) == 6
        assert len(set(connections)) == 1  # one connection for all six
        await assert_idle(h)


async def test_with_two_relay_threads_the_cap_holds_for_every_stream() -> None:
    cap = 3
    async with start_gateway(gate={"max_concurrency_per_gpu": cap}, server={"workers": 2}) as h:
        body = {
            "model": "fake-model",
            "stream": True,
            "max_tokens": 20,
            "messages": [{"role": "user", "content": "hi"}],
            "fake": {"itl": 0.005},
        }
        results = await asyncio.gather(*(_stream(h.client, CHAT, body) for _ in range(24)))
        assert [status for status, _ in results] == [200] * 24
        for _, text in results:
            chunks = [e for e in _events(text) if isinstance(e, dict)]
            got = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
            assert got
            assert text.endswith("data: [DONE]\n\n")
        assert h.fake.peak_running == cap  # the fake's own count: never past the cap
        assert h.fake.completed == 24
