"""Broken backend replies: malformed SSE, a 500 (before or in the middle of a stream), an early
close, a dropped connection.

Each fault hits `CLIENTS` requests at once, streamed and not. A streamed
client whose reply had started gets the error as the stream's last word (never a bare
`[DONE]` that reads as success); one that had not gets a 502 with an OpenAI-style body; a
non-streamed client gets a 502. What was sent before the fault reaches the client intact,
a backend left mid-reply is aborted (counted by the fake), and nothing is left behind.
"""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import pytest

from tests.gateway.harness import start_gateway

from .replies import CHAT, chat, stream_chat
from .zero import assert_back_to_zero, fakes_running

pytestmark = pytest.mark.anyio

CLIENTS = 3  # requests per fault, per kind (streamed and not)
SENT = 2  # tokens the backend sends before its fault

# fault -> (the fake's plan, how the fake counts the request afterwards)
FAULTS: dict[str, tuple[dict[str, Any], str]] = {
    "malformed_sse": ({"malformed_after": SENT}, "aborted"),  # the gateway must close it
    "error_event_mid_stream": ({"error_after": SENT}, "broken"),  # vLLM's in-band 500
    "early_close": ({"close_after": SENT}, "broken"),  # body ends, no [DONE]
    "connection_dropped": ({"crash_after": SENT}, "aborted"),
    "status_500": ({"status": 500}, "none"),
}


@pytest.mark.parametrize("fault", list(FAULTS))
async def test_a_broken_reply_ends_every_client_with_a_visible_error(fault: str) -> None:
    plan, counted = FAULTS[fault]
    async with start_gateway() as h:
        h.fake.default = plan
        streamed = [stream_chat(h.client, max_tokens=20) for _ in range(CLIENTS)]
        body = chat(stream=False, max_tokens=20)
        plain = [h.client.post(CHAT, json=body) for _ in range(CLIENTS)]
        got = await asyncio.wait_for(asyncio.gather(*streamed, *plain), timeout=20)
        for reply in got[:CLIENTS]:
            if fault == "status_500":
                assert reply.status == 502, reply
                assert reply.events[0]["error"]["code"] == "backend_error"
                continue
            assert reply.status == 200, reply
            assert reply.text == "t0 t1 "  # what came before the fault, intact
            reply.assert_failed_visibly()
        for response in got[CLIENTS:]:
            assert response.status_code == 502, response.text
            error = response.json()["error"]
            assert error["message"]
            assert error["code"] in ("backend_error", "upstream_error"), error
        assert h.fake.seen == 2 * CLIENTS
        if counted != "none":
            assert getattr(h.fake, counted) == 2 * CLIENTS, h.fake
        assert h.fake.completed == 0
        await assert_back_to_zero(h.url, fakes_running(h.fakes.values()))


@pytest.mark.parametrize("fault", ["malformed_sse", "error_event_mid_stream", "early_close"])
async def test_the_openai_client_raises_on_a_broken_stream(fault: str) -> None:
    """The real `openai` client reads each broken stream as an error, not a short answer."""
    async with start_gateway() as h:
        client = openai.AsyncOpenAI(base_url=f"{h.url}/v1", api_key="none", max_retries=0)
        stream = await client.chat.completions.create(
            model="fake-model",
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            max_tokens=20,
            extra_body={"fake": FAULTS[fault][0]},
        )
        text: list[str] = []

        async def read() -> None:
            async for chunk in stream:
                text.extend(c.delta.content or "" for c in chunk.choices)

        with pytest.raises(openai.APIError):
            await read()
        assert "".join(text) == "t0 t1 "
        await client.close()
        await assert_back_to_zero(h.url, fakes_running(h.fakes.values()))
