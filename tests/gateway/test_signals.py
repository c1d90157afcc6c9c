"""Client signals on the wire: a client's retry count and deadline, from its headers.

One slot, held by a request the fake vLLM never answers, so a newcomer must wait. What reached
vLLM is read at the fake (`bodies`): a request whose client deadline the queue cannot meet is
answered 429 `client_deadline` with a Retry-After and never reaches it, with a `traceparent`
header or without one alike; a
queued one leaves when its deadline passes. The real `openai` client's own timeout header is
honoured as it sends it. Unusable foreign headers are ignored; a malformed header of ours is a
400.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import openai
import pytest

from llmflow.gateway.signals import ClientSignals, read_signals

from .harness import Harness, start_gateway, until

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
HOLD = {"model": "fake-model", "messages": [{"role": "user", "content": "hold"}],
        "fake": {"hang": True}}
# Without and with a `traceparent` (which the route reads, for its span).
ROUTE = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
PATHS = [pytest.param({}, id="plain"), pytest.param(ROUTE, id="route")]


def _body(tag: str) -> dict[str, Any]:
    return {"model": "fake-model", "messages": [{"role": "user", "content": tag}], "max_tokens": 3}


def _reached(h: Harness) -> list[str]:
    return [b["messages"][0]["content"] for b in h.fake.bodies]


async def _held(h: Harness) -> asyncio.Task[Any]:
    task = asyncio.create_task(h.client.post(CHAT, json=HOLD))
    await until(lambda: h.fake.running == 1)
    return task


def _gateway(**signals: Any) -> Any:
    return start_gateway(
        gate={"max_concurrency_per_gpu": 1,
              "queue": {"max_waiting": 8, "max_wait_ms": 30_000, "follow_drain": False}},
        streaming={"sse_flush_interval": 0, "first_token_timeout_ms": None},
        signals={"min_deadline_ms": 100, **signals},
    )


@pytest.fixture
async def gw() -> AsyncIterator[Harness]:
    async with _gateway() as h:
        yield h


@pytest.mark.parametrize("path", PATHS)
async def test_a_deadline_the_queue_cannot_meet_never_reaches_vllm(
    gw: Harness, path: dict[str, str]
) -> None:
    """The slot drains one request per 10 s (the prior hold, nothing measured yet): a client
    that waits 2 s is refused at once, told to come back in the 8 s its budget falls short,
    and vLLM never sees it. One that waits 60 s queues, and is served once the slot frees."""
    hold = await _held(gw)
    refused = await gw.client.post(
        CHAT, json=_body("short"), headers={"x-llmflow-deadline-ms": "2000", **path}
    )
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "client_deadline"
    assert refused.headers["retry-after"] == "8"
    metrics = (await gw.client.get("/metrics")).text
    assert 'outcome="rejected",reason="client_deadline",tier="normal"} 1.0' in metrics
    patient = asyncio.create_task(gw.client.post(
        CHAT, json=_body("patient"), headers={"x-stainless-timeout": "60", **path}
    ))
    await until(lambda: gw.gateway.runtime.queued == 1)
    hold.cancel()
    assert (await patient).status_code == 200
    assert _reached(gw) == ["hold", "patient"]


async def test_the_openai_clients_own_timeout_is_its_deadline(gw: Harness) -> None:
    """The unmodified `openai` client sends its timeout (`x-stainless-read-timeout`, seconds)
    and its retry count: with a 2 s timeout it hears a 429 `client_deadline` at once, well
    inside its timeout, and vLLM never sees the request."""
    hold = await _held(gw)
    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0,
                                  timeout=2.0) as client:
        with pytest.raises(openai.RateLimitError) as raised:
            await client.chat.completions.create(
                model="fake-model", messages=[{"role": "user", "content": "sdk"}], max_tokens=3
            )
    assert raised.value.code == "client_deadline"
    assert raised.value.response.headers["retry-after"] == "8"
    hold.cancel()
    await until(lambda: gw.fake.running == 0)
    assert _reached(gw) == ["hold"]


@pytest.mark.parametrize("path", PATHS)
async def test_a_queued_request_leaves_when_its_client_deadline_passes(path: dict[str, str]
                                                                       ) -> None:
    """Once one request has completed, the slot's measured hold is short, so a client that
    waits 0.4 s queues; the slot stays held, and when its 0.4 s pass it is answered 429
    `client_deadline` and leaves the queue: nothing of it reaches vLLM, even after the slot
    frees."""
    async with _gateway() as h:
        assert (await h.client.post(CHAT, json=_body("quick"))).status_code == 200
        hold = await _held(h)
        start = time.monotonic()
        late = await h.client.post(
            CHAT, json=_body("late"), headers={"x-llmflow-deadline-ms": "400", **path}
        )
        assert time.monotonic() - start >= 0.4
        assert late.status_code == 429
        assert late.json()["error"]["code"] == "client_deadline"
        assert int(late.headers["retry-after"]) >= 1
        assert h.gateway.runtime.queued == 0
        hold.cancel()
        await until(lambda: h.fake.running == 0)
        assert _reached(h) == ["quick", "hold"]
        metrics = (await h.client.get("/metrics")).text
        assert 'outcome="timeout",reason="client_deadline",tier="normal"} 1.0' in metrics


async def test_signals_can_be_turned_off() -> None:
    """With `signals.deadline_headers: false` the same 2 s client waits in the queue."""
    async with _gateway(deadline_headers=False) as h:
        hold = await _held(h)
        waiting = asyncio.create_task(h.client.post(
            CHAT, json=_body("waits"), headers={"x-llmflow-deadline-ms": "2000"}
        ))
        await until(lambda: h.gateway.runtime.queued == 1)
        hold.cancel()
        assert (await waiting).status_code == 200
        assert _reached(h) == ["hold", "waits"]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("value", ["soon", "-5", "0", "1.5", "99999999999"])
async def test_a_malformed_deadline_of_ours_is_a_400(
    gw: Harness, path: dict[str, str], value: str
) -> None:
    r = await gw.client.post(
        CHAT, json=_body("bad"), headers={"x-llmflow-deadline-ms": value, **path}
    )
    assert r.status_code == 400
    error = r.json()["error"]
    assert (error["code"], error["param"]) == ("invalid_deadline", "x-llmflow-deadline-ms")
    assert "whole number of milliseconds" in error["message"]
    assert gw.fake.bodies == []


@pytest.mark.parametrize(
    "headers",
    [
        {"x-stainless-timeout": "soon"},
        {"x-stainless-timeout": "-3"},
        {"x-stainless-timeout": "nan"},
        {"x-stainless-read-timeout": "inf"},
        {"x-stainless-timeout": "1e306"},  # finite, but past any float as milliseconds
        {"x-stainless-retry-count": "-1"},
        {"x-stainless-retry-count": "many"},
        {"x-envoy-attempt-count": "0"},
        {"x-envoy-attempt-count": "99999999999"},
    ],
)
async def test_unusable_foreign_headers_are_ignored(gw: Harness, headers: dict[str, str]
                                                    ) -> None:
    r = await gw.client.post(CHAT, json=_body("fine"), headers=headers)
    assert r.status_code == 200
    assert _reached(gw) == ["fine"]


def _read(*headers: tuple[str, str]) -> ClientSignals:
    return read_signals([(k.encode(), v.encode()) for k, v in headers])


def test_what_each_header_means() -> None:
    """The SDKs count retries before this attempt; Envoy numbers attempts from 1; ours wins
    over an SDK's timeout (seconds, whole or not)."""
    assert _read() == ClientSignals()
    assert _read(("x-stainless-retry-count", "2")) == ClientSignals(retries=2)
    assert _read(("x-envoy-attempt-count", "1")) == ClientSignals(retries=0)
    assert _read(("x-envoy-attempt-count", "3"), ("x-stainless-retry-count", "1")).retries == 2
    assert _read(("x-stainless-timeout", "600")) == ClientSignals(deadline_ms=600_000)
    assert _read(("x-stainless-read-timeout", "2.5")) == ClientSignals(deadline_ms=2_500)
    both = _read(("x-stainless-timeout", "600"), ("x-llmflow-deadline-ms", "1500"))
    assert both.deadline_ms == 1_500


@pytest.mark.parametrize("path", PATHS)
async def test_an_announced_retry_reaches_the_core(gw: Harness, path: dict[str, str]) -> None:
    """A retry count above zero (the SDK's, or Envoy's attempt number above one) is an
    announced retry; a first attempt is not."""
    for headers in ({"x-stainless-retry-count": "0"}, {"x-envoy-attempt-count": "1"},
                    {"x-stainless-retry-count": "2"}, {"x-envoy-attempt-count": "3"}):
        r = await gw.client.post(CHAT, json=_body("again"), headers={**headers, **path})
        assert r.status_code == 200
    counters = (await gw.client.get("/api/state")).json()["core"]["counters"]
    assert counters["retries_announced"] == 2
    assert _reached(gw) == ["again"] * 4
