"""A backend that never gives a first token: the first-token timeout fires, upstream is aborted.

The fake accepts each request and never sends a byte (`hang`). Streamed or not, and in both
of the timeout's modes (`degrade`: a 200 that
ends with the notice; `error`: a 504 with Retry-After), every client gets its answer, the fake
counts every request aborted by the gateway, and nothing is left behind.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.gateway.harness import start_gateway

from .replies import CHAT, chat, stream_chat
from .zero import assert_back_to_zero, fakes_running

pytestmark = pytest.mark.anyio

CLIENTS = 4  # hung requests per case
TIMEOUT_MS = 300


@pytest.mark.parametrize("mode", ["degrade", "error"])
async def test_a_backend_that_never_answers_is_aborted_at_the_first_token_timeout(
    mode: str,
) -> None:
    async with start_gateway(
        streaming={"first_token_timeout_ms": TIMEOUT_MS, "on_first_token_timeout": mode},
        sla={"ttft_ms": None},
    ) as h:
        h.fake.default = {"hang": True}
        streamed = [stream_chat(h.client, max_tokens=5) for _ in range(CLIENTS)]
        plain = [h.client.post(CHAT, json=chat(stream=False, max_tokens=5)) for _ in range(CLIENTS)]
        got = await asyncio.wait_for(asyncio.gather(*streamed, *plain), timeout=20)
        assert h.fake.seen == 2 * CLIENTS
        assert h.fake.aborted == 2 * CLIENTS  # the fake's own count: every upstream closed
        for reply in got[:CLIENTS]:
            if mode == "error":
                assert reply.status == 504, reply
                assert int(reply.headers["retry-after"]) >= 1
                assert reply.events[0]["error"]["code"] == "first_token_timeout"
            else:
                assert reply.status == 200, reply
                assert reply.notice == {"truncated": True, "reason": "first_token_timeout"}
                assert reply.done
        for response in got[CLIENTS:]:
            if mode == "error":
                assert response.status_code == 504, response.text
                assert response.json()["error"]["code"] == "first_token_timeout"
            else:
                assert response.status_code == 200, response.text
                assert response.json()["llmflow"]["reason"] == "first_token_timeout"
        await assert_back_to_zero(h.url, fakes_running(h.fakes.values()))
